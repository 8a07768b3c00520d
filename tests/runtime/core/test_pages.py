"""Page geometry and memory planning (plain integers, no model)."""

from __future__ import annotations

import pytest

from oscar_compile.runtime.core.page_plan import GIB, CacheLayout, LayerFormat, plan_pages

QWEN3_8B = dict(num_layers=36, num_kv_heads=8, head_dim=128)


def test_bytes_per_token_match_the_perf_notes():
    # PERF_NOTES: Qwen3-8B is 147,456 B of KV per token in BF16 and 20,736 B in INT2 (fp16 s/z).
    layout = CacheLayout.uniform(**QWEN3_8B)
    assert layout.window_page_bytes == 147_456 * layout.page_size
    assert layout.quant_page_bytes == 20_736 * layout.page_size
    fp32 = CacheLayout.uniform(**QWEN3_8B, scale_dtype="float32")
    assert fp32.quant_page_bytes == 36 * 8 * 80 * 16  # K + V: 80 B per KV head per token


def test_sixteen_bit_layers_store_history_in_full_precision():
    base = CacheLayout.uniform(**QWEN3_8B)
    mixed = CacheLayout.uniform(**QWEN3_8B, full_precision_layers=(0, 35))
    per_layer_int2 = 2 * 8 * 16 * (32 + 4)
    per_layer_bf16 = 2 * 8 * 16 * 256
    assert mixed.quant_page_bytes - base.quant_page_bytes == 2 * (per_layer_bf16 - per_layer_int2)
    assert not mixed.is_full_precision
    explicit = CacheLayout(**QWEN3_8B, layer_formats=tuple(
        LayerFormat(bits=16) if i in (0, 35) else LayerFormat() for i in range(36)))
    assert explicit.quant_page_bytes == mixed.quant_page_bytes


def test_bf16_mode_has_no_windows_and_full_precision_pages():
    layout = CacheLayout.bf16(**QWEN3_8B)
    assert layout.is_full_precision and layout.num_window_pages_per_seq == 0
    assert layout.quant_page_bytes == layout.window_page_bytes
    assert layout.num_pages_for_seq(33) == (0, 3)  # every token in a page: ceil(33 / 16)


@pytest.mark.parametrize("kwargs, field", [
    (dict(sink=8), "sink"), (dict(recent=-16), "recent"), (dict(bits=3), "bits"),
    (dict(group_size=48), "group_size"), (dict(scale_dtype="int8"), "scale_dtype"),
    (dict(full_precision_layers=(36,)), "full_precision_layers"), (dict(page_size=0), "page_size"),
])
def test_layout_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CacheLayout.uniform(**{**QWEN3_8B, **kwargs})


@pytest.mark.parametrize("L, expected", [(0, 0), (64, 0), (320, 0), (321, 1), (336, 16), (337, 17)])
def test_history_is_positions_s0_to_l_minus_w(L, expected):
    layout = CacheLayout.uniform(**QWEN3_8B)  # S0 = 64, W = 256
    assert layout.num_history_tokens(L) == expected
    assert layout.num_pages_for_seq(L) == (20, -(-expected // 16))


def test_history_rule_agrees_with_the_kernels_pool_helpers():
    pools = pytest.importorskip("oscar_compile.kernels.pools")
    for sink, recent in [(0, 0), (16, 32), (64, 256), (32, 0)]:
        layout = CacheLayout.uniform(**QWEN3_8B, sink=sink, recent=recent)
        for L in range(0, 700, 7):
            assert layout.num_history_tokens(L) == pools.num_history_tokens(L, sink, recent)
            assert (layout.num_quant_pages_for(layout.num_history_tokens(L))
                    == pools.num_quant_pages_needed(L, sink, recent, 16))
        assert layout.num_window_pages_per_seq == pools.num_window_pages_per_seq(sink, recent, 16)


def test_from_spec_resolves_layer_overrides():
    spec_mod = pytest.importorskip("oscar_compile.spec")
    from transformers import Qwen3Config

    config = Qwen3Config(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=128, hidden_size=256)
    spec = spec_mod.CompressionSpec.from_dict({"layers": [{"match": [0, -1], "kv_cache": {"bits": 16}}]})
    layout = CacheLayout.from_spec(spec, config)
    assert [layout.format_of(i).bits for i in range(4)] == [16, 2, 2, 16]
    assert (layout.sink, layout.recent, layout.page_size) == (64, 256, 16)
    uneven = spec_mod.CompressionSpec.from_dict({"layers": [{"match": [1], "kv_cache": {"recent_tokens": 128}}]})
    with pytest.raises(NotImplementedError, match="per-layer"):
        CacheLayout.from_spec(uneven, config)


def test_plan_pages_balances_windows_and_history_at_the_expected_length():
    layout = CacheLayout.uniform(**QWEN3_8B)
    budget = 40 * GIB
    plan = plan_pages(layout, budget, max_num_seqs=1000, expected_seq_len=32_768)
    num_window, num_quant = layout.num_pages_for_seq(32_768)
    num_seqs = plan.num_window_pages // num_window
    assert plan.num_window_pages == num_seqs * num_window
    assert plan.num_quant_pages >= num_seqs * num_quant  # every windowed sequence fits at 32k
    used = plan.num_window_pages * layout.window_page_bytes + plan.num_quant_pages * layout.quant_page_bytes
    assert budget - layout.quant_page_bytes < used <= budget


def test_plan_pages_caps_sequences_and_refuses_tiny_budgets():
    layout = CacheLayout.uniform(**QWEN3_8B)
    plan = plan_pages(layout, 40 * GIB, max_num_seqs=4, expected_seq_len=1024)
    assert plan.num_window_pages == 4 * 20
    with pytest.raises(ValueError, match="windows of one sequence"):
        plan_pages(layout, layout.window_page_bytes * 19, 4, 1024)
    with pytest.raises(ValueError, match="history page"):
        plan_pages(layout, layout.window_page_bytes * 20, 4, 100)
    with pytest.raises(ValueError, match="kv memory"):
        plan_pages(layout, 0, 4, 100)
    bf16 = plan_pages(CacheLayout.bf16(**QWEN3_8B), GIB, 8, 1024)
    assert bf16.num_window_pages == 0 and bf16.num_quant_pages == GIB // (147_456 * 16)


def test_per_layer_windows_matter_only_beside_quantized_layers():
    """One page table serves every layer: per-layer windows are refused when a layer is
    quantized; with every layer at 16 bits there are no windows (apply drops them), so none."""
    from types import SimpleNamespace

    from oscar_compile import CompressionSpec

    config = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    override = [{"match": [0], "kv_cache": {"sink_tokens": 0, "recent_tokens": 0}}]
    for bits in (2, 16):
        spec = CompressionSpec.from_dict({"kv_cache": {"bits": bits, "group_size": 32, "sink_tokens": 16,
                                                       "recent_tokens": 16}, "layers": override})
        if bits == 2:
            with pytest.raises(NotImplementedError, match="per-layer sink/recent"):
                CacheLayout.from_spec(spec, config)
        else:
            assert CacheLayout.from_spec(spec, config).is_full_precision
