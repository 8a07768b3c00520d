"""Method names: YAML files, shipped specs, built-in variants, KIVI; honest bits per element."""
import pytest

from oscar_compile.evaluation.methods import BUILTIN_VARIANTS, DEFAULT_METHODS, resolve_method, resolve_methods
from oscar_compile.evaluation.names import BUILTIN_VARIANT_NAMES


def test_every_default_method_resolves():
    methods = resolve_methods(DEFAULT_METHODS)
    assert [m.name for m in methods] == list(DEFAULT_METHODS)
    assert methods[0].is_reference and not any(m.is_reference for m in methods[1:])


def test_the_cli_knows_every_builtin_variant():
    assert tuple(BUILTIN_VARIANTS) == BUILTIN_VARIANT_NAMES


def test_builtin_variants_change_only_what_they_say():
    base = resolve_method("oscar-int2").spec
    per_head = resolve_method("oscar-int2-per-head").spec
    attn = resolve_method("oscar-int2-attn-output").spec
    assert per_head.key.granularity == per_head.value.granularity == "per_head"
    assert attn.value.target == "attention_output"
    assert per_head.kv_cache == attn.kv_cache == base.kv_cache


def test_yaml_file_is_named_after_its_stem(tmp_path):
    path = tmp_path / "my-method.yaml"
    path.write_text(resolve_method("hadamard-int2").spec.to_yaml())
    m = resolve_method(str(path))
    assert m.name == "my-method" and m.spec.key.rotation == "hadamard"


def test_unknown_and_duplicate_names_fail_loudly(tmp_path):
    with pytest.raises(ValueError, match="unknown method 'oscar-int3'.*kivi-int2"):
        resolve_method("oscar-int3")
    (tmp_path / "oscar-int2.yaml").write_text("version: 1\n")
    with pytest.raises(ValueError, match="two methods are named 'oscar-int2'"):
        resolve_methods(["oscar-int2", str(tmp_path / "oscar-int2.yaml")])
    with pytest.raises(FileNotFoundError):
        resolve_method(str(tmp_path / "missing.yaml"))


def test_bits_per_element():
    oscar, bf16, kivi = (resolve_method(n) for n in ("oscar-int2", "bf16", "kivi-int2"))
    assert oscar.bits_per_element(128, 8, None) == 2.25
    assert bf16.bits_per_element(128, 8, 4096) == 16.0
    # 4096 tokens: 64 + 256 in BF16, the rest at 2.25 bits
    assert oscar.bits_per_element(128, 8, 4096) == pytest.approx((3776 * 2.25 + 320 * 16) / 4096)
    assert kivi.bits_per_element(128, 8, None) == 3.0
