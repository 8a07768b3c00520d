"""The keys a prompt's prefix is routed by: chained hashes of its tokens at the engine's
snapshot boundaries.

Why those boundaries. Under decode-consistent prefill a prefix-cache hit resumes only where a
window snapshot was taken (runtime/core/window_snapshots.py): every ``interval`` tokens, and at the
last page boundary before a prompt's last token (a resend). A replica that served a prompt holds
snapshots at exactly those lengths, so a later prompt can gain from that replica only as far as
the longest such boundary the two prompts share. Hashing there, and nowhere else, gives the
router one key per prefix a replica can resume at, and a table a few entries a request long.

Keys are chained (the key at a boundary covers every token before it), so equal keys mean equal
prefixes, whatever the prompts hold after them.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixKeys:
    """The routing keys of one prompt, shortest prefix first: ``keys[i]`` covers
    ``lengths[i]`` tokens. Travels with the request to the router (a handle call's kwargs)."""

    lengths: tuple[int, ...]
    keys: tuple[bytes, ...]


def boundaries(num_tokens: int, interval: int, page_size: int) -> list[int]:
    """The snapshot boundaries of a prompt of ``num_tokens``: multiples of ``interval`` before
    its last token, and its last page boundary before the last token (sorted, distinct, > 0)."""
    if interval < 1 or page_size < 1:
        raise ValueError(f"interval and page_size must be >= 1, got {interval} and {page_size}")
    ends = set(range(interval, num_tokens, interval))
    end = (num_tokens - 1) // page_size * page_size
    if end > 0:
        ends.add(end)
    return sorted(ends)


def prefix_keys(token_ids: list[int], interval: int, page_size: int) -> PrefixKeys:
    """The chained keys of ``token_ids`` at its snapshot boundaries."""
    lengths = boundaries(len(token_ids), interval, page_size)
    digest = hashlib.blake2b(digest_size=16, person=b"oscar-route")
    keys, start = [], 0
    for end in lengths:
        digest.update(array("q", token_ids[start:end]).tobytes())
        keys.append(digest.copy().digest())
        start = end
    return PrefixKeys(tuple(lengths), tuple(keys))
