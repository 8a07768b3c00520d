"""apply(), the elementwise fusion and the bundled model, with Hugging Face's `kernels` package
installed and absent: both must give the same model.

With `kernels` importable, transformers (>= 5.23 with kernels >= 0.18) wraps
`apply_rotary_pos_emb` in a hub-kernel module and decorates RMSNorm; that broke every `apply()`
(issue 38). The modeling modules are decorated when they are imported, so each case runs in a
fresh interpreter. 'absent' hides the package: with `sys.modules["kernels"] = None`,
`importlib.util.find_spec("kernels")` answers None, which is how transformers probes for it.
"""
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import inspect, json, sys
if HIDE:
    sys.modules["kernels"] = None
import torch
from transformers.models.qwen3 import modeling_qwen3
from transformers.utils.import_utils import is_kernels_available
from oscar_compile import CompressionSpec, apply, calibrate
from oscar_compile import Rotations
from oscar_compile.loading import BUNDLED_MODEL_DIR, load_model
from oscar_compile.testing import tiny_model

torch.manual_seed(0)
out = {"kernels_available": is_kernels_available(),
       "rope_is_plain_function": inspect.isfunction(modeling_qwen3.apply_rotary_pos_emb)}
batches = [torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(123))]
ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(7))
for fuse in (False, True):
    model = tiny_model("qwen3", num_heads=4, num_kv_heads=2, head_dim=32)
    reference = model(ids).logits
    spec = CompressionSpec.from_dict({
        "kv_cache": {"bits": 16, "group_size": 32, "sink_tokens": 16, "recent_tokens": 16},
        "key": {"rotation": "oscar", "center": True}, "value": {"rotation": "oscar"}})
    report = apply(model, spec, calibrate(model, spec, batches), fuse=fuse).report
    out[f"max_logit_error_fuse_{fuse}"] = float((model(ids).logits - reference).abs().max())
    out[f"fused_fuse_{fuse}"] = dict(report.fused)
model, tokenizer = load_model(BUNDLED_MODEL_DIR, device="cpu", dtype="float32")
spec = CompressionSpec.from_yaml(BUNDLED_MODEL_DIR.parents[1] / "specs" / "oscar-int2.yaml")
apply(model, spec, Rotations.load(BUNDLED_MODEL_DIR / "rotations" / "oscar-int2.safetensors", model))
prompt = tokenizer("def fibonacci(n):" * 80, return_tensors="pt").input_ids  # past sink + recent: INT2 is read
out["bundled_tokens"] = model.generate(prompt, max_new_tokens=8, do_sample=False)[0, prompt.shape[1]:].tolist()
print("RESULT " + json.dumps(out))
"""


def _kernels_installed() -> bool:
    try:
        importlib.metadata.version("kernels")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _run(hide: bool) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", f"HIDE = {hide}\n{SCRIPT}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.fixture(scope="module")
def absent() -> dict:
    return _run(hide=True)


def test_without_the_kernels_package(absent):
    assert not absent["kernels_available"] and absent["rope_is_plain_function"]
    for fuse in (False, True):
        assert absent[f"max_logit_error_fuse_{fuse}"] <= 1e-4
    assert absent["fused_fuse_True"] == {"rms_norm": 9, "silu_mul": 2, "rope": 2, "qkv_gemm": 2, "gate_up_gemm": 2}


@pytest.mark.skipif(not _kernels_installed(), reason="Hugging Face's `kernels` package is not installed")
def test_with_the_kernels_package_the_model_is_the_same(absent):
    installed = _run(hide=False)
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) >= Version("5.23"):  # older releases ignore `kernels` 0.19
        assert installed["kernels_available"] and not installed["rope_is_plain_function"]
    for key, value in absent.items():
        if key not in ("kernels_available", "rope_is_plain_function"):
            assert installed[key] == value, key
