"""The shipped specs, end to end through the CLI, on every supported family at head_dim 64 and 128.

A user's path: ``oscar-compile calibrate`` writes rotations, ``oscar-compile demo`` applies the
spec and generates beside the BF16 model, ``oscar-compile serve`` compresses with the written
rotations and answers a completion whose prompt is long enough to quantize history pages. The
spec says ``group_size: 128``; on head_dim 64 every command must fit it to the model the same
way (one group per head row), where serve used to refuse what calibrate had accepted.

Tiny random models (2 layers, 1 KV head) from transformers config objects: no downloads.
"""
import gc
from pathlib import Path

import numpy as np
import pytest

from oscar_compile import Rotations
from oscar_compile.cli import main
from oscar_compile.spec import specs_dir
from oscar_compile.testing import tiny_model, tiny_tokenizer

SPEC = str(specs_dir() / "oscar-int2.yaml")
PROMPT_TOKENS = 400  # past the 64 sink + 256 recent tokens: history pages get quantized


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _model_dir(tmp_path, tokenizer, arch, head_dim) -> Path:
    path = tmp_path / f"{arch}-{head_dim}"
    model = tiny_model(arch, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=head_dim, vocab_size=len(tokenizer))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    np.random.default_rng(0).integers(0, len(tokenizer), 2048 + 64).astype("<u2").tofile(path / "calib.bin")
    return path


class _Served(Exception):
    """Raised by the stand-in for uvicorn once the request went through."""


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "mistral"])
def test_calibrate_apply_generate_serve(tmp_path, tokenizer, arch, head_dim, capsys, monkeypatch):
    model_dir = _model_dir(tmp_path, tokenizer, arch, head_dim)
    rot_file = tmp_path / "rot.safetensors"
    assert main(["calibrate", "--model", str(model_dir), "--spec", SPEC, "--data", str(model_dir / "calib.bin"),
                 "--out", str(rot_file), "--num-tokens", "2048", "--quiet", "--device", "cpu"]) == 0
    rot = Rotations.load(rot_file)
    assert rot.k[0].shape == (1, head_dim, head_dim)
    assert rot.spec.kv_cache.group_size == min(128, head_dim)  # the artifact records the fitted spec

    assert main(["demo", "--model", str(model_dir), "--spec", SPEC, "--max-new-tokens", "2",
                 "--calib-tokens", "1024", "--device", "cpu", "--prompt", "hello " * 200]) == 0
    text = capsys.readouterr().out
    assert "oscar::attention" in text and "greedy-token agreement" in text

    from starlette.testclient import TestClient

    from oscar_compile.cli import serve  # the module that assembles; runtime.serve re-exports it

    answers = []

    def run_server(app, args):  # in place of uvicorn: one request through the app the CLI built
        assert gc.get_freeze_count() > 0  # the startup heap is left out of collections while serving
        with TestClient(app) as client:
            prompt = np.random.default_rng(1).integers(3, len(tokenizer), PROMPT_TOKENS).tolist()
            answers.append(client.post("/v1/completions", json={"model": model_dir.name, "prompt": prompt,
                                                                "max_tokens": 3, "temperature": 0}))

    monkeypatch.setattr(serve, "run_server", run_server)
    assert main(["serve", "--model", str(model_dir), "--spec", SPEC, "--rotations", str(rot_file),
                 "--device", "cpu", "--kv-memory", "0.01", "--max-model-len", "512", "--no-cuda-graphs"]) == 0
    (answer,) = answers
    assert gc.get_freeze_count() == 0
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["usage"] == {**body["usage"], "prompt_tokens": PROMPT_TOKENS, "completion_tokens": 3}


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_every_shipped_spec_fits_the_common_head_dims(head_dim):
    from oscar_compile.spec import shipped_spec
    from oscar_compile.spec_fit import fit_spec

    for path in sorted(specs_dir().glob("*.yaml")):
        fitted = fit_spec(shipped_spec(path.stem), head_dim, num_layers=4)
        kv = fitted.kv_cache
        assert kv.bits == 16 or head_dim % kv.group_size == 0, path.name
        assert kv.group_size == min(shipped_spec(path.stem).kv_cache.group_size, head_dim)
        assert fit_spec(fitted, head_dim, num_layers=4) == fitted  # idempotent


def test_a_spec_that_does_not_fit_is_refused_by_every_command_with_one_message(tmp_path, tokenizer, capsys):
    model_dir = _model_dir(tmp_path, tokenizer, "llama", 64)
    spec = tmp_path / "g48.yaml"
    spec.write_text("kv_cache: {group_size: 48}\nkey: {rotation: hadamard}\nvalue: {rotation: hadamard}\n")
    expected = "layer 0: group_size 48 does not divide head_dim 64"
    assert main(["calibrate", "--model", str(model_dir), "--spec", str(spec), "--data", "missing.bin",
                 "--out", str(tmp_path / "r.safetensors")]) == 2
    calibrate_err = capsys.readouterr().err
    assert main(["serve", "--model", str(model_dir), "--spec", str(spec), "--device", "cpu"]) == 2
    serve_err = capsys.readouterr().err
    assert expected in calibrate_err and expected in serve_err
    assert calibrate_err.split("error: ", 1)[1] == serve_err.split("error: ", 1)[1]
