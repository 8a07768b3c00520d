"""``oscar-compile sweep``: the exact knapsack, the formats and their costs, the mixed spec that
apply / eval / the runtime load as they are, reproducibility, and the errors users hit."""
import itertools
import json
import random
import shutil

import numpy as np
import pytest
import torch
import yaml

from oscar_compile.cli import main as cli_main
from oscar_compile.evaluation.allocation import BudgetError, Choice, allocate, budget_units
from oscar_compile.evaluation.fixtures import write_tiny_model_dir
from oscar_compile.evaluation.methods import resolve_method
from oscar_compile.evaluation.mixed_precision import layer_formats, spec_yaml, with_formats
from oscar_compile.evaluation.sweep import SweepConfig, plan, sweep
from oscar_compile.spec import CompressionSpec, shipped_spec


# -- the knapsack ------------------------------------------------------------------------------
def _brute_force(choices, budget):
    best = None
    for combo in itertools.product(*[range(len(layer)) for layer in choices]):
        picked = [choices[li][j] for li, j in enumerate(combo)]
        if any(c.gain is None for c in picked) or sum(c.cost for c in picked) > budget:
            continue
        gain = sum(c.gain for c in picked)
        if best is None or gain > best + 1e-12:
            best = gain
    return best


@pytest.mark.parametrize("seed", range(30))
def test_knapsack_is_optimal_and_never_over_budget(seed):
    rng = random.Random(seed)
    choices = []
    for _ in range(rng.randint(1, 6)):
        base = rng.choice([288, 320])
        layer = [Choice(base, 0.0)]
        for cost in sorted(rng.sample([320, 384, 544, 2048], rng.randint(1, 3))):
            layer.append(Choice(cost, None if rng.random() < 0.1 else rng.uniform(-0.1, 1.0)))
        choices.append(layer)
    floor = sum(layer[0].cost for layer in choices)
    budget = floor + rng.randint(0, 2000)
    picked = allocate(choices, budget)
    assert sum(choices[li][j].cost for li, j in enumerate(picked)) <= budget
    assert all(choices[li][j].gain is not None for li, j in enumerate(picked))
    assert sum(choices[li][j].gain for li, j in enumerate(picked)) == pytest.approx(_brute_force(choices, budget))


def test_knapsack_beats_greedy_by_gain_per_bit():
    # Greedy by gain per extra bit takes layer 0's cheap upgrade first and then cannot afford layer 1's.
    choices = [[Choice(288, 0.0), Choice(320, 0.4), Choice(544, 0.5)], [Choice(288, 0.0), Choice(544, 2.0)]]
    assert allocate(choices, 288 + 544) == [0, 1]


def test_knapsack_ties_go_to_the_cheaper_total_and_errors():
    assert allocate([[Choice(288, 0.0), Choice(544, 0.0)]], 1000) == [0]
    with pytest.raises(BudgetError, match="below the cheapest"):
        allocate([[Choice(288, 0.0)], [Choice(288, 0.0)]], 575)
    assert budget_units(2.3, 128, 8) == 2355  # floor(23/10 * 1024), read from the decimal text
    assert budget_units("2.5", 128, 8) == 2560


# -- formats and the spec ----------------------------------------------------------------------
def test_format_costs_are_the_eval_reports_asymptotic_bits():
    spec = shipped_spec("oscar-int2")
    formats = layer_formats(spec, 0, 128, 8, group_sizes=(64, 32))
    assert [(f.name, f.cost) for f in formats] == [("int2-g128", 288), ("int2-g64", 320), ("int2-g32", 384),
                                                   ("int4-g128", 544), ("bf16", 2048)]
    int4 = next(f for f in formats if f.bits == 4)
    assert int4.override["key"]["clip_ratio"] == shipped_spec("oscar-int4").key.clip_ratio
    chosen = {i: formats[0] for i in range(8)} | {2: int4, 5: formats[1]}
    mixed = with_formats(spec, chosen)
    assert CompressionSpec.from_dict(yaml.safe_load(spec_yaml(mixed, ["a comment"]))) == mixed
    method = resolve_method("oscar-int2")
    mixed_method = type(method)("mixed", "test", spec=mixed)
    assert mixed_method.bits_per_element(128, 8, None) * 128 * 8 == sum(chosen[i].cost for i in range(8))
    layers = [mixed.for_layer(i, 8) for i in range(8)]
    assert [layer.kv_cache.bits for layer in layers] == [2, 2, 4, 2, 2, 2, 2, 2]
    assert layers[2].key.clip_ratio == 0.99 and layers[5].kv_cache.group_size == 64


def test_formats_of_one_name_reached_by_different_overrides_stay_apart():
    """Layer 0 (INT4 in the base) offered groups of 64 and layer 1 (INT2, groups of 64) raised to
    INT4 both become "int4-g64", through different overrides: each layer keeps its own."""
    from oscar_compile.evaluation.mixed_precision import Format

    spec = shipped_spec("oscar-int2")
    regroup = Format("int4-g64", 4, 64, 576, {"kv_cache": {"group_size": 64}})
    raise_bits = Format("int4-g64", 4, 64, 576, {"kv_cache": {"bits": 4, "group_size": 64}})
    mixed = with_formats(spec, {0: regroup, 1: raise_bits})
    assert [o.match for o in mixed.layers[-2:]] == [[0], [1]]
    assert mixed.for_layer(1, 8).kv_cache.bits == 4 and mixed.for_layer(0, 8).kv_cache.bits == 2


def test_budget_below_the_int2_floor_is_refused_before_loading():
    with pytest.raises(BudgetError, match="2.25 bits per element"):
        plan("oscar-int2", 2.2, 128, 8)
    with pytest.raises(ValueError, match="nothing to allocate"):
        plan("bf16", 3.0, 128, 8)
    with pytest.raises(ValueError, match="positive"):
        SweepConfig(budget="abc")


# -- end to end on a tiny model ----------------------------------------------------------------
SPEC = """version: 1
kv_cache: {bits: 2, group_size: 128, sink_tokens: 16, recent_tokens: 32}
calibration: {num_tokens: 1024, seq_len: 256}
key: {rotation: oscar}
value: {rotation: oscar}
"""
ARGS = ["--context", "256", "--scored-tokens", "64", "--num-windows", "2", "--quiet"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    model = write_tiny_model_dir(root / "model", num_layers=3, heldout_tokens=4096, calib_tokens=2048)
    (root / "base.yaml").write_text(SPEC)
    return root, model


@pytest.fixture(scope="module")
def swept(tiny):
    root, model = tiny
    out = root / "out" / "mixed-{budget}.yaml"
    assert cli_main(["sweep", "--model", str(model), "--spec", str(root / "base.yaml"), "--budget", "2.5", "3.0",
                     "--group-sizes", "64", "--out", str(out), *ARGS]) == 0
    return root, model, root / "out"


def test_cli_writes_spec_json_table_and_plot_per_budget(swept, capsys):
    root, model, out = swept
    for budget in ("2.5", "3.0"):
        spec = CompressionSpec.from_yaml(out / f"mixed-{budget}.yaml")
        results = json.loads((out / f"mixed-{budget}.json").read_text())
        bpe = resolve_method(str(out / f"mixed-{budget}.yaml")).bits_per_element(128, 3, None)
        assert bpe == results["chosen"]["bits_per_element"] <= float(budget)
        assert results["base"]["kl"] > 0 and len(results["layers"]) == 3 and results["bf16"]["nll"] > 0
        assert results["chosen"]["kl"] <= results["base"]["kl"]
        assert spec == CompressionSpec.from_json(json.dumps(results["spec_json"]))
        assert "| layer |" in (out / f"mixed-{budget}.md").read_text()
        for row in results["layers"]:
            bf16 = next(o for o in row["options"] if o["format"] == "bf16")
            assert bf16["kl"] is None and "exceed" in bf16["skipped"]  # 16 bits cannot fit 3.0 on 3 layers
    pytest.importorskip("matplotlib")
    assert (out / "mixed-2.5.png").is_file()


def test_same_inputs_and_seed_give_the_same_spec(tiny):
    root, model = tiny
    settings = dict(model=str(model), spec=str(root / "base.yaml"), budget="3.0", context=256, scored_tokens=64,
                    num_windows=2)
    a, b = sweep(**settings), sweep(**settings)
    assert a["spec"] == b["spec"] and a["layers"] == b["layers"]
    assert spec_yaml(a["spec"]) == spec_yaml(b["spec"])


def test_the_mixed_spec_is_served_by_apply_and_the_runtime(swept):
    from oscar_compile import apply, calibrate
    from oscar_compile.calibration.tokens import load_tokens, make_batches
    from oscar_compile.loading import load_model
    from oscar_compile.runtime import LLM, SamplingParams

    root, model_dir, out = swept
    spec = CompressionSpec.from_yaml(out / "mixed-3.0.yaml")
    assert {spec.for_layer(i, 3).kv_cache.bits for i in range(3)} != {2}  # something was raised
    model, tok = load_model(model_dir, "cpu")
    batches = make_batches(load_tokens(model_dir / "calib.bin"), spec.calibration, tok.bos_token_id)
    rot = calibrate(model, spec, batches)
    llm = LLM(str(model_dir), spec=str(out / "mixed-3.0.yaml"), rotations=rot, device="cpu")
    ids = load_tokens(model_dir / "heldout.bin")[:100].tolist()
    assert len(llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0].token_ids) == 4
    report = apply(model, spec, rot).report
    assert report is not None


def test_bad_inputs_get_clear_errors(tiny, tmp_path, capsys):
    root, model = tiny
    base = ["sweep", "--model", str(model), "--spec", str(root / "base.yaml"), *ARGS]
    assert cli_main([*base, "--budget", "2.0", "--out", str(tmp_path / "x.yaml")]) == 2
    assert "below what base costs at its cheapest: 2.25 bits per element" in capsys.readouterr().err
    assert cli_main([*base, "--budget", "2.5", "--data", str(model / "calib.bin"),
                     "--out", str(tmp_path / "x.yaml")]) == 2
    assert "are the same file" in capsys.readouterr().err
    assert cli_main([*base, "--budget", "2.5", "3", "--out", str(tmp_path / "x.yaml")]) == 2
    assert "{budget}" in capsys.readouterr().err
    bare = tmp_path / "bare"
    shutil.copytree(model, bare)
    (bare / "heldout.bin").unlink()
    assert cli_main(["sweep", "--model", str(bare), "--spec", str(root / "base.yaml"), "--budget", "2.5",
                     "--out", str(tmp_path / "x.yaml"), *ARGS]) == 2
    assert "heldout.bin: pass --data" in capsys.readouterr().err


def test_kl_is_zero_for_bf16_and_positive_under_int2_on_the_same_windows(tiny):
    from oscar_compile.evaluation.sensitivity import continuation_divergence, reference_logprobs, tail_windows
    from oscar_compile.loading import load_model

    root, model_dir = tiny
    tokens = torch.arange(1000) % 256
    windows = tail_windows(tokens, 256, 2, bos=300)
    assert windows[:, 0].tolist() == [300, 300] and windows[-1, -1] == tokens[-1]  # the end of the file
    assert windows[0, 1] == tokens[1000 - 2 * 255]
    model, _ = load_model(model_dir, "cpu")
    ids = tail_windows(torch.from_numpy(np.fromfile(model_dir / "heldout.bin", "<u2").astype("int64")),
                       256, 2, model.config.bos_token_id)
    ref = reference_logprobs(model, ids, 64, batch_size=1)
    kivi = resolve_method("kivi-int2-g32-r32")
    from oscar_compile.evaluation.prepare import method_quantizers

    quant, _ = method_quantizers(model, kivi, None, None, None, None)
    res = continuation_divergence(model, {"bf16": [None] * 3, "kivi": quant}, ids, ref, 64, batch_size=1)
    assert res["bf16"]["kl"] == pytest.approx(0.0, abs=1e-9) and res["bf16"]["tokens"] == 128
    assert res["kivi"]["kl"] > 1e-6
