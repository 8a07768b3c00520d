"""``oscar-compile eval`` end to end on a tiny slice: files written, splits kept apart, plots optional."""
import json
import shutil

import pytest

from oscar_compile.cli import main as cli_main
from oscar_compile.evaluation import evaluate
from oscar_compile.evaluation.fixtures import write_tiny_model_dir


def main(argv):
    return cli_main(["eval", *argv])


WINDOWS = {"kv_cache": "{bits: 2, group_size: 128, sink_tokens: 16, recent_tokens: 32}",
           "calibration": "{num_tokens: 1024, seq_len: 256}"}


def _spec(path, rotation, clip_k=0.96, clip_v=0.92):
    path.write_text(f"version: 1\nkv_cache: {WINDOWS['kv_cache']}\ncalibration: {WINDOWS['calibration']}\n"
                    f"key: {{rotation: {rotation}, clip_ratio: {clip_k}}}\n"
                    f"value: {{rotation: {rotation}, clip_ratio: {clip_v}}}\n")
    return str(path)


@pytest.fixture(scope="module")
def slice_args(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model = write_tiny_model_dir(root / "model", heldout_tokens=4096, calib_tokens=2048)
    specs = ["bf16", _spec(root / "naive.yaml", "none", 1.0, 1.0), _spec(root / "oscar.yaml", "oscar"),
             "kivi-int2-g32-r64"]
    return root, ["--model", str(model), "--specs", *specs, "--context", "192", "256", "--num-samples", "2",
                  "--ppl-tokens", "32", "--gen-tokens", "8", "--metric-queries", "16", "--needle-per-cell", "1",
                  "--needle-depths", "0", "1", "--quiet"]


@pytest.fixture(scope="module")
def full_run(slice_args):
    root, args = slice_args
    out = root / "out"
    assert main([*args, "--out", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text())


def test_cli_writes_table_json_and_plots(full_run):
    out, results = full_run
    names = ["bf16", "naive", "oscar", "kivi-int2-g32-r64"]
    assert list(results["methods"]) == names
    for task in ("perplexity", "agreement"):
        assert set(results[task]["256"]) == set(names)
    assert results["agreement"]["256"]["bf16"]["agreement"] == 1.0
    assert results["perplexity"]["192"]["oscar"]["ppl"] > 1
    assert set(results["needle"]["by_length"]["oscar"]) == {"192", "256"}
    assert all(layer["hidden_rel_err"] > 0 for layer in results["layers"]["metrics"]["naive"])
    assert results["bits_per_element"]["oscar"]["asymptotic"] == 2.25
    table = (out / "results.md").read_text()
    for heading in ("Bits per element", "Perplexity", "Greedy-token agreement", "Needle", "Per-layer fidelity"):
        assert heading in table
    assert (out / "rotations" / "oscar.safetensors").is_file()
    pytest.importorskip("matplotlib")
    assert {p.name for p in out.glob("*.png")} == {"by_context.png", "layers.png", "needle.png"}


def test_rotations_dir_is_used_instead_of_calibrating(slice_args, full_run):
    root, args = slice_args
    out, first = full_run
    oscar_yaml = args[5]
    again = evaluate(model=args[1], specs=[oscar_yaml], contexts=[192, 256], num_samples=2, ppl_tokens=32,
                     tasks=["perplexity"], rotations_dir=str(out / "rotations"))
    assert again["methods"]["oscar"]["rotations"].startswith("loaded")
    for c in ("192", "256"):
        assert again["perplexity"][c]["oscar"] == first["perplexity"][c]["oscar"]


def test_without_matplotlib_table_and_json_still_written(slice_args, monkeypatch, caplog):
    root, args = slice_args
    import oscar_compile.evaluation.plots as plots

    monkeypatch.setattr(plots, "_pyplot", lambda: None)
    out = root / "no-plots"
    results = evaluate(model=args[1], specs=["bf16", "kivi-int2-g32-r64"], contexts=[192], num_samples=1,
                       ppl_tokens=32, tasks=["perplexity"], out=str(out))
    assert results["plots"] == [] and "matplotlib is not installed" in caplog.text
    assert (out / "results.md").is_file() and (out / "results.json").is_file()
    assert not list(out.glob("*.png"))


def test_same_file_for_calibration_and_evaluation_is_refused(slice_args, tmp_path, capsys):
    root, args = slice_args
    heldout = root / "model" / "heldout.bin"
    assert main([*args, "--calib", str(heldout), "--out", str(tmp_path)]) == 2
    assert "are the same file" in capsys.readouterr().err
    copy = tmp_path / "copy.bin"
    shutil.copy(heldout, copy)  # same bytes under another name
    with pytest.raises(ValueError, match="same file"):
        evaluate(model=args[1], calib=str(copy), specs=["bf16"], contexts=[192], ppl_tokens=32, gen_tokens=8,
                 metric_queries=16)


def test_deterministic_perplexity_does_not_depend_on_the_batch_size(slice_args):
    """``--deterministic``: batch-invariant linears, and each window's loss added in window order
    (a batch-wide sum once made batch 1 and batch 4 differ in the last digits)."""
    root, args = slice_args
    runs = [evaluate(model=args[1], specs=["bf16", "kivi-int2-g32-r64"], contexts=[192], num_samples=4,
                     ppl_tokens=32, tasks=["perplexity"], batch_size=b, deterministic=True)["perplexity"]
            for b in (1, 4)]
    assert runs[0] == runs[1]
