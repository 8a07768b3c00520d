"""kernels.jit_watch: compiles are counted, and warned about once the server serves."""
from __future__ import annotations

import pytest

from oscar_compile.kernels import jit_watch


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(jit_watch, "_serving", False)
    monkeypatch.setattr(jit_watch, "_stats", {key: 0 for key in jit_watch._stats})


def test_compiles_while_serving_are_counted_and_warned(fresh, caplog):
    jit_watch.note_compile("warmup_kernel", 3.0)
    assert not caplog.records
    jit_watch.mark_serving()
    with caplog.at_level("WARNING", logger=jit_watch.__name__):
        jit_watch.note_compile("_attn_kernel[num_warps=4](B: i32)", 4.5)
    assert "_attn_kernel" in caplog.text and "4.5 s while serving" in caplog.text
    assert jit_watch.compile_stats() == {"jit_compiles_total": 2, "jit_compiles_while_serving": 1,
                                         "jit_compile_seconds_while_serving": 4.5}


def test_the_hooks_time_a_compile_and_keep_the_hooks_already_set(fresh, monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    calls = []
    monkeypatch.setattr(jit_watch, "_installed", False)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: calls.append("cache"))
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append("post"))
    assert jit_watch.install() and jit_watch.install()  # once
    jit_watch.mark_serving()
    assert knobs.runtime.jit_cache_hook(repr="k") is None  # (None: Triton goes on to compile)
    knobs.runtime.jit_post_compile_hook(repr="k")
    assert calls == ["cache", "post"]
    stats = jit_watch.compile_stats()
    assert stats["jit_compiles_while_serving"] == 1 and stats["jit_compile_seconds_while_serving"] >= 0


def test_metrics_report_the_compile_counters(fresh):
    from oscar_compile.runtime.server import metrics

    jit_watch.mark_serving()
    jit_watch.note_compile("k", 2.0)
    stats = {key: 0 for *_, key in metrics._SCALARS}
    stats.update({f"{kind}_{suffix}": 0 for *_, suffix in metrics._PAGES for kind in metrics.PAGE_KINDS})
    stats.update({f"fork_{kind}_pages_{how}": 0 for kind in ("window", "quant") for how in ("shared", "copied")})
    text = metrics.render_metrics(stats)
    assert "\noscar_jit_compiles_while_serving_total 1.0\n" in text
    assert "\noscar_jit_compile_seconds_while_serving_total 2.0\n" in text


def test_a_compile_is_described_by_its_constexpr_names():
    class Param:
        def __init__(self, name):
            self.name = name

    fn = type("Info", (), {"jit_function": type("F", (), {"params": [Param("q_ptr"), Param("BLOCK_M")]})()})()
    text = jit_watch._describe({"repr": "_attn_kernel(q_ptr: *bf16)", "fn": fn,
                                "compile": {"constants": {(1,): 16, (0, 2): 1.5}}})
    assert text == "_attn_kernel(q_ptr: *bf16) with BLOCK_M=16"
    text = jit_watch._describe({"repr": "k", "fn": fn, "compile": {
        "constants": {}, "configs": [{(0,): [["tt.divisibility", 16]]}]}})
    assert text == "k with divisible by 16: q_ptr"
