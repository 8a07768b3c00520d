"""Prefix keys: one per snapshot boundary, equal exactly where the prefixes are equal."""

from oscar_compile.runtime.server.ray_serve.prefix_keys import boundaries, prefix_keys


def test_boundaries_are_the_engines_snapshot_points():
    # multiples of the interval before the last token, and the last page boundary before it
    assert boundaries(1040, 256, 16) == [256, 512, 768, 1024]
    assert boundaries(1000, 256, 16) == [256, 512, 768, 992]
    assert boundaries(1025, 256, 16) == [256, 512, 768, 1024]
    assert boundaries(1024, 256, 16) == [256, 512, 768, 1008]  # 1024 leaves no token to compute
    assert boundaries(16, 256, 16) == []


def test_keys_match_on_shared_prefixes_only():
    doc = list(range(1000, 2024))  # 1024 tokens
    a, b = prefix_keys(doc + [1, 2, 3], 256, 16), prefix_keys(doc + [4, 5, 6, 7], 256, 16)
    assert a.lengths == b.lengths == (256, 512, 768, 1024)
    assert a.keys == b.keys  # the same document: every key equal
    c = prefix_keys(doc[:300] + [9] + doc[301:] + [1, 2, 3], 256, 16)  # differs at token 300
    assert c.keys[0] == a.keys[0] and all(x != y for x, y in zip(c.keys[1:], a.keys[1:], strict=True))
    assert len(set(a.keys)) == len(a.keys)  # chained: each key covers its whole prefix
