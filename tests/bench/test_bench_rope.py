"""bench.rope's reference side on the CPU (Triton's interpreter): the float64 rotation it measures
errors against agrees with the ieee path, and a bf16x3 run is scored against both."""
import os

import pytest
import torch

from oscar_compile.bench import rope
from oscar_compile.kernels.elementwise import elementwise_triton as ew


def test_the_rotation_errors_score_the_ieee_path_against_float64():
    pytest.importorskip("triton")
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU side, under TRITON_INTERPRET=1 (the README's test command); a GPU runs the benchmark")
    args = rope.rope_inputs(20, torch.device("cpu"))
    ieee = ew.rope_triton(*args, precision="ieee")
    exact = rope.exact_rotation(*args)
    scored = rope.rotation_errors(ieee, ieee, exact)
    for row in scored:
        assert row["differ_from_ieee"] == 0.0
        assert 0 < row["rel_fro_vs_fp64"] < 1e-2  # the bf16 output's rounding (the interpreter truncates)
    split = rope.rotation_errors(ew.rope_triton(*args, precision="bf16x3", rows_per_program=64), ieee, exact)
    for row, base in zip(split, scored, strict=True):
        assert row["rel_fro_vs_fp64"] < 1.1 * base["rel_fro_vs_fp64"]
        assert row["differ_from_ieee"] < 0.01
    assert {v[0] for v in rope.VARIANTS} == {"ieee", "bf16x3"}
