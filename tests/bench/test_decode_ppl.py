"""The decode-kernel perplexity bench scores each token by the decode step that predicts it.

With the BF16 spec nothing is quantized, so teacher-forced decode steps must give the NLL of one
plain forward over the window (an off-by-one in the loop would not). On a CPU no kernel is
dispatched: the run checks the command end to end on a few short windows.
"""

from __future__ import annotations

import json

import pytest
import torch

from oscar_compile.bench.decode_ppl import main, teacher_forced_nll
from oscar_compile.loading import BUNDLED_MODEL_DIR

pytestmark = pytest.mark.skipif(not (BUNDLED_MODEL_DIR / "config.json").exists(), reason="no bundled model")


def test_teacher_forced_steps_equal_one_forward_in_bf16():
    from oscar_compile import apply, calibrate
    from oscar_compile.loading import load_model
    from oscar_compile.spec import shipped_spec

    model, _ = load_model(BUNDLED_MODEL_DIR, "cpu", torch.float32)
    windows = torch.randint(2, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(windows).logits.float()
        want = torch.nn.functional.cross_entropy(
            logits[:, 29:39].reshape(-1, logits.shape[-1]), windows[:, 30:40].reshape(-1), reduction="none"
        ).view(2, 10).mean(1)
        spec = shipped_spec("bf16")
        apply(model, spec, calibrate(model, spec))
        got = teacher_forced_nll(model, windows, 10)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_command_runs_on_the_cpu(tmp_path):
    out = tmp_path / "ppl.json"
    argv = ["--device", "cpu", "--context", "96", "--scored", "8", "--num-samples", "2", "--out", str(out)]
    assert main([*argv, "--kernels", "triton", "auto"]) == 0
    result = json.loads(out.read_text())
    a, b = result["kernels"]["triton"], result["kernels"]["auto"]
    assert result["windows"] == 2 and a["cost_vs_first"] == 0 and a["ppl"] > 1
    assert b["nll"] == a["nll"]  # the CPU runs the references whatever the setting
