"""The decode-consistent benchmark's row (bench/decode_consistent.py) on a tiny shape under the
Triton interpreter: every path runs and the error against the reference comes back (CUDA-event
timing needs a GPU, so the timer is a stand-in here: the numbers are not checked, the keys are)."""

import os

import pytest

import oscar_compile.bench.decode_consistent as bench


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs under TRITON_INTERPRET=1 (CI)")
def test_row_times_every_path_and_checks_the_kernel(monkeypatch):
    pytest.importorskip("triton")
    ran = []
    monkeypatch.setattr(bench, "time_ms", lambda fn, reps: ran.append(fn()) or 1.0)
    row = bench.bench_shape(330, 12, device="cpu")  # 10 history tokens, a chunk crossing into the history
    assert len(ran) == 2
    for name in ("prompt_exact", "decode_consistent"):
        assert row[f"{name}_ms"] == 1.0
    assert row["rel_err"] < 1e-2
