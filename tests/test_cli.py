"""The oscar-compile CLI: calibrate, inspect, demo on tiny models (no downloads)."""
import numpy as np
import pytest

from oscar_compile import Rotations
from oscar_compile.cli import main
from oscar_compile.testing import tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tiny_model("qwen3", head_dim=32).save_pretrained(path)
    return path


def test_calibrate_then_inspect(model_dir, tmp_path, capsys):
    data = tmp_path / "calib.bin"
    np.random.default_rng(0).integers(0, 128, 3000).astype("<u2").tofile(data)
    spec = tmp_path / "spec.yaml"
    spec.write_text("kv_cache: {group_size: 32}\ncalibration: {num_tokens: 2048, seq_len: 512, batch_size: 2}\n")
    out = tmp_path / "rot.safetensors"
    assert main(["calibrate", "--model", str(model_dir), "--spec", str(spec), "--data", str(data),
                 "--out", str(out), "--quiet", "--device", "cpu"]) == 0
    rot = Rotations.load(out)
    assert rot.num_tokens == 2048 and rot.k[0].shape == (2, 32, 32)
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "importance before" in text and text.count("\n") >= 4 + 2 * 2
    # OSCAR's key rotation equalises the importance diagonal exactly (Lemma 1): after = 1.00
    key_rows = [line.split() for line in text.splitlines() if line.strip().startswith(("0 k", "1 k"))]
    assert all(row[4] == "1.00" for row in key_rows)


def test_calibrate_reports_user_errors(model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("key: {rotaton: oscar}\n")
    assert main(["calibrate", "--model", str(model_dir), "--spec", str(bad), "--data", "x", "--out", "y"]) == 2
    assert "key.rotaton: unknown field" in capsys.readouterr().err


def test_demo_on_a_tiny_model(capsys):
    assert main(["demo", "--tiny", "--max-new-tokens", "4", "--calib-tokens", "1024"]) == 0
    text = capsys.readouterr().out
    assert "oscar::attention" in text and "bits per K/V element" in text and "greedy-token agreement" in text
    # 400 prompt + 4 generated tokens past the tiny spec's 16 sink + 64 recent: the agreement reads INT2
    assert "INT2 history read at the last step: 323 of 403 tokens" in text and "note:" not in text


def test_serve_and_bench_are_subcommands(capsys):
    """``oscar-compile serve`` takes the flags of ``python -m oscar_compile.runtime.serve``;
    ``oscar-compile bench NAME ARGS`` hands ARGS to ``python -m oscar_compile.bench.NAME``."""
    for argv in (["serve", "--help"], ["bench", "serve_random", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--kv-memory" in text and "--max-num-seqs" in text and "--shape" in text


def test_python_m_forms_still_run():
    """``python -m oscar_compile.cli`` and the promised ``python -m oscar_compile.runtime.serve``."""
    import subprocess
    import sys

    for module in ("oscar_compile.cli", "oscar_compile.runtime.serve"):
        done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "usage:" in done.stdout, done.stderr


def test_python_m_evaluation_is_the_eval_command(capsys):
    """``python -m oscar_compile.evaluation`` runs ``oscar-compile eval`` without the top-level CLI
    (which sits above the evaluation): same usage, same status 2 and one line for a user error."""
    from oscar_compile.evaluation.command import main as eval_main

    helps = []
    for run in (lambda: main(["eval", "--help"]), lambda: eval_main(["--help"])):
        with pytest.raises(SystemExit) as exit_info:
            run()
        assert exit_info.value.code == 0
        helps.append(capsys.readouterr().out)
    assert helps[0] == helps[1] and helps[0].startswith("usage: oscar-compile eval")
    assert main(["eval", "--model", "/nonexistent"]) == eval_main(["--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == err[1] and err[0].startswith("oscar-compile eval: error:")


def test_export_onnx_without_its_extra_says_so_and_writes_nothing(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "onnxscript", None)  # find_spec answers None: not installed
    out = tmp_path / "onnx-out"
    assert main(["export", "--format", "onnx", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "onnxscript" in err and "pip install 'oscar-compile[onnx]'" in err
    assert not out.exists()
