"""The extend benchmark's row (bench/extend.py) on a tiny step under the Triton interpreter: every
path runs on the same inputs and its error against attention_ref comes back (CUDA-graph timing
needs a GPU, so the timer is a stand-in here: the numbers are not checked, the keys are)."""
import os

import pytest

import oscar_compile.bench.extend as extend
import oscar_compile.bench.kernel_setup as kernel_setup


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs under TRITON_INTERPRET=1 (CI)")
def test_extend_row_times_every_path_and_checks_both_int2_paths(monkeypatch):
    pytest.importorskip("triton")
    ran = []
    monkeypatch.setattr(extend, "graph_time_us", lambda calls, reps=10: ran.append(calls[0]()) or 100.0)
    monkeypatch.setattr(kernel_setup, "num_buffers", lambda layer_bytes: 1)  # one layer buffer per path
    row = extend.bench_extend(340, 1, chunk=4, device="cpu")  # 20 history tokens, 4 new
    assert len(ran) == 4 and row["extend_scratch_bytes"] > 0
    for name in ("paged_bf16", "int2", "extend", "dequant"):
        assert row[f"{name}_us"] == 100.0
    assert row["int2_rel_err"] < 1e-2 and row["extend_rel_err"] < 1e-2
