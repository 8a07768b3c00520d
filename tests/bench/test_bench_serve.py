"""The end-to-end benchmark runs (tiny shape, CPU): the real runner, INT2 and BF16 mode, JSON out."""
import json

import pytest

from oscar_compile.bench.serve import main


def test_serve_benchmark_smoke(tmp_path, capsys):
    out = tmp_path / "serve.json"
    assert main(["--shapes", "tiny", "--contexts", "64", "--capacity-contexts", "96", "--kv-memory", "0.002",
                 "--device", "cpu", "--reps", "1", "--e2e-batches", "2", "--e2e-prompt", "40", "--e2e-output", "3",
                 "--e2e-kv-memory", "0.01", "--compare-unfused", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    modes = sorted((r["mode"], r["fused"], r["context"]) for r in result["decode"])
    assert modes == [("bf16", False, 64), ("bf16", True, 64), ("int2", False, 64), ("int2", True, 64)]
    for r in result["decode"]:
        assert r["step_ms"] > 0 and abs(sum(r["breakdown"].values()) - 1) < 1e-6
        assert (r["breakdown"]["norm_act"] > 0) == r["fused"]  # the fused ops show up, and only when fused
    capacity = {c["mode"]: c["max_seqs"] for c in result["capacity"]}
    assert capacity["int2"] > capacity["bf16"] >= 1  # same budget, smaller pages
    e2e = {e["system"]: e for e in result["e2e"]}
    assert set(e2e) == {"oscar-int2", "oscar-bf16", "hf-cb"}
    for name in ("oscar-int2", "oscar-bf16"):
        assert "error" not in e2e[name], e2e[name]
        assert e2e[name]["generated_tokens"] == 2 * 3 and e2e[name]["decode_steps"] >= 1
    assert "max seqs" in capsys.readouterr().out


def test_int2_variant_systems_run_with_their_engine_settings(tmp_path, monkeypatch):
    import oscar_compile.runtime as runtime

    made = []

    class RecordingLLM(runtime.LLM):
        def __init__(self, *args, config=None, **kwargs):
            made.append(config)
            super().__init__(*args, config=config, **kwargs)

    monkeypatch.setattr(runtime, "LLM", RecordingLLM)
    out = tmp_path / "serve.json"
    systems = ["oscar-int2-no-prefix-caching", "oscar-int2-prompt-exact"]
    assert main(["--shapes", "tiny", "--device", "cpu", "--parts", "e2e", "--e2e-batches", "2", "--e2e-prompt", "40",
                 "--e2e-output", "3", "--e2e-kv-memory", "0.01", "--e2e-systems", *systems, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["e2e"]
    assert [r["system"] for r in rows] == systems  # the order given
    assert all("error" not in r and r["generated_tokens"] == 2 * 3 for r in rows), rows
    no_cache, exact = made
    assert not no_cache.enable_prefix_caching and no_cache.prefill_semantics == "decode-consistent"
    assert exact.enable_prefix_caching and exact.prefill_semantics == "prompt-exact"


class _Event:
    """A CUDA event stand-in at time t (ms) on the device clock."""

    def __init__(self, t: float):
        self.t = t

    def elapsed_time(self, end: "_Event") -> float:
        return end.t - self.t


def test_host_share_is_the_idle_part_of_the_decode_phase_on_the_device_clock():
    """Forwards (start, end) in ms: a prefill, two decode steps, a mixed step, a decode step. The
    phase runs from 300 to 414 ms; forwards cover 15 + 14 + 69 + 14 of it, the mixed step's
    included. Host wall times per step (which an overlapped engine does not line up with its
    forwards) play no part."""
    from oscar_compile.bench.e2e import _StepClock

    clock = object.__new__(_StepClock)
    clock.arrivals = {}
    forwards = [("prefill", 0, 300), ("decode", 300, 315), ("decode", 316, 330), ("mixed", 331, 400),
                ("decode", 400, 414)]
    clock.steps = [(kind, 0.001, (_Event(a), _Event(b))) for kind, a, b in forwards]
    clock.shapes = [(1, 8), (2, 2), (2, 2), (2, 9), (2, 2)]
    clock.run_host_s = [0.030, 0.001, 0.001, 0.0069, 0.001]
    summary = clock.summary()
    assert summary["decode_steps"] == 3
    assert abs(summary["host_share_of_decode_step"] - 2 / 114) < 1e-12
    # the mixed step: 6.9 ms in run() on the host against its 69 ms forward
    mixed = summary["mixed_steps"]
    assert mixed["count"] == 1 and mixed["tokens_median"] == 9 and mixed["forward_ms_median"] == 69
    assert abs(mixed["host_over_forward"] - 0.1) < 1e-12
    assert mixed["device_gap_ms_median"] == 1  # from the decode forward's end at 330 to its start at 331
    assert summary["prefill_steps"]["device_gap_ms_median"] is None  # the first forward: none before it
    assert summary["prefill_steps"]["forward_ms_median"] == 300


def test_step_kind():
    from types import SimpleNamespace

    from oscar_compile.bench.e2e import step_kind

    assert step_kind(SimpleNamespace(token_ids=[[1], [2]])) == "decode"
    assert step_kind(SimpleNamespace(token_ids=[[1], [2, 3]])) == "mixed"
    assert step_kind(SimpleNamespace(token_ids=[[1, 2], [3, 4, 5]])) == "prefill"


def test_prefill_and_swap_parts_smoke(tmp_path, capsys):
    """``--parts ttft swap`` alone on the CPU: both prompt-exact prefill paths, decode-consistent
    prefill with no staging, its prefix hits at window snapshots, the BF16 mode's miss, one swap
    round trip."""
    out = tmp_path / "parts.json"
    assert main(["--shapes", "tiny", "--device", "cpu", "--parts", "ttft", "swap", "--ttft-contexts", "200",
                 "--ttft-new-tokens", "64", "--swap-context", "150", "--max-num-batched-tokens", "64", "--reps", "1",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert not result["decode"] and not result["capacity"]
    rows = {(r["engine"], r["request"]): r for r in result["ttft"]}
    assert sorted(rows) == [("bf16-mode", "miss"), ("consistent", "miss"), ("consistent+cache", "follow-up"),
                            ("consistent+cache", "miss"), ("consistent+cache", "resend"), ("exact", "miss"),
                            ("exact+staging", "miss")]
    assert all(r["ttft_s"] > 0 and r["context"] == 200 for r in rows.values())
    bf16 = rows["bf16-mode", "miss"]  # the BF16 mode's miss, and every row against it
    assert bf16["ttft_vs_bf16"] == 1.0 and bf16["staging_peak_bytes"] == 0
    assert all(r["ttft_vs_bf16"] == r["ttft_s"] / bf16["ttft_s"] for r in rows.values())
    staged = rows["exact+staging", "miss"]
    assert staged["staging_peak_bytes"] > 0 == rows["exact", "miss"]["staging_peak_bytes"]
    for r in rows.values():
        if r["prefill_semantics"] == "decode-consistent":  # stages nothing: saves the staged peak
            assert r["staging_peak_bytes"] == r["staging_pool_bytes"] == 0
            assert r["staging_saved_bytes"] == staged["staging_peak_bytes"]
    miss, resend, follow_up = (rows["consistent+cache", k] for k in ("miss", "resend", "follow-up"))
    assert miss["num_cached_prompt_tokens"] == 0
    # the resend resumes at the snapshot at its last page boundary (16-token pages), the
    # follow-up (a new last 64 tokens) at the sink: 136 shared tokens hold no periodic snapshot
    assert resend["num_cached_prompt_tokens"] == 192 and follow_up["num_cached_prompt_tokens"] == 16
    assert resend["window_snapshot_hits"] >= 1 and resend["miss_over_hit"] > 0
    assert "follow-up" in capsys.readouterr().out
    (swap,) = result["swap"]
    assert swap["bytes"] > 0 and swap["swap_out_ms"] > 0 and swap["recompute_ms"] > 0


def test_ttft_engines_pick_the_int2_rows(tmp_path):
    """``--ttft-engines`` runs only the engines named, beside the BF16 mode's row; a row whose
    comparison engine did not run carries no ratio to it."""
    out = tmp_path / "ttft.json"
    assert main(["--shapes", "tiny", "--device", "cpu", "--parts", "ttft", "--ttft-contexts", "100",
                 "--ttft-engines", "consistent", "--max-num-batched-tokens", "64", "--out", str(out)]) == 0
    rows = {r["engine"]: r for r in json.loads(out.read_text())["ttft"]}
    assert sorted(rows) == ["bf16-mode", "consistent"]
    assert "ttft_vs_old" not in rows["consistent"] and "staging_saved_bytes" not in rows["consistent"]
    assert rows["consistent"]["ttft_vs_bf16"] == rows["consistent"]["ttft_s"] / rows["bf16-mode"]["ttft_s"]


def test_tensor_parallel_rows_over_two_ranks(tmp_path):
    """``--tensor-parallel-size 2`` on the CPU (gloo): the split rows with their all-reduce share,
    and twice the sequences of the unsplit model in the same per-rank KV budget."""
    import torch

    from oscar_compile.bench.serve import GIB, _bytes_per_seq, build_model

    out = tmp_path / "tp.json"
    assert main(["--shapes", "tiny", "--device", "cpu", "--tensor-parallel-size", "2", "--contexts", "64",
                 "--capacity-contexts", "96", "--kv-memory", "0.002", "--reps", "1", "--parts", "decode", "capacity",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert sorted(r["mode"] for r in result["decode"]) == ["bf16", "int2"]
    for r in result["decode"]:
        assert r["tensor_parallel_size"] == 2 and abs(sum(r["breakdown"].values()) - 1) < 1e-6
        assert r["breakdown"]["all_reduce"] > 0
    for c in result["capacity"]:  # a rank's pages hold half the KV heads
        _, unsplit = build_model("tiny", c["mode"], 128, torch.device("cpu"))
        assert c["max_seqs"] == int(0.002 * GIB) // (_bytes_per_seq(unsplit, 96) // 2) >= 2


def test_structured_part_smoke(tmp_path, monkeypatch):
    """``--parts structured`` on the CPU (the overlapped compressed runner), with the tests' small
    tokenizer standing in for the 151,936-token one (training that takes a minute): both runs,
    the mask and compile times, the TTFTs."""
    import pytest

    pytest.importorskip("xgrammar")
    from oscar_compile.bench import bpe_tokenizer
    from oscar_compile.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    monkeypatch.setattr(bpe_tokenizer, "load", lambda: tokenizer)
    monkeypatch.setattr(bpe_tokenizer, "QWEN3_VOCAB_SIZE", len(tokenizer))
    out = tmp_path / "structured.json"
    assert main(["--shapes", "tiny", "--device", "cpu", "--parts", "structured", "--structured-batch", "3",
                 "--structured-prompt", "12", "--structured-output", "10", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["structured"]
    assert row["vocab_size"] == len(tokenizer) and row["compile_ms"] > 0 and row["ttft_cold_ms"] > 0
    assert row["plain"]["generated_tokens"] == 30 and row["plain"]["full_batch_decode_step_ms"] > 0
    assert row["json"]["num_mask_fills"] > 0 and row["json"]["mask_ms_per_step"] > 0
    assert row["decode_step_cost"] is not None


def test_steps_part_profiles_the_prefill_and_mixed_steps_of_both_modes(tmp_path, capsys):
    """--parts steps: a whole-budget chunk, and the same budget as a chunk beside decode rows, in
    INT2 and the BF16 mode, each with its largest ops' time (CPU: self time per op), then INT2
    against BF16 per step."""
    from oscar_compile.bench.serve_steps import step_shapes

    out = tmp_path / "serve.json"
    assert main(["--shapes", "tiny", "--device", "cpu", "--parts", "steps", "--max-num-batched-tokens", "48",
                 "--step-contexts", "48", "80", "--step-decodes", "3", "--reps", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    shapes = sorted((r["mode"], r["kind"], r["context"], r["tokens"], r["seqs"]) for r in result["steps"])
    assert shapes == sorted((mode, kind, context, 48, seqs) for mode in ("int2", "bf16") for context in (48, 80)
                            for kind, seqs in (("prefill", 1), ("mixed", 4)))
    for row in result["steps"]:
        assert row["step_ms"] > 0 and 0 < len(row["kernels_ms"]) <= 20
        assert all(ms >= 0 for ms in row["kernels_ms"].values())
    assert any("oscar::attention_bf16" in r["kernels_ms"] for r in result["steps"] if r["mode"] == "bf16")
    pairs = result["steps_int2_vs_bf16"]
    assert sorted((p["kind"], p["context"]) for p in pairs) == [("mixed", 48), ("mixed", 80), ("prefill", 48),
                                                                 ("prefill", 80)]
    for p in pairs:
        assert p["ratio"] == p["int2_ms"] / p["bf16_ms"]
    assert "mixed at 80: INT2" in capsys.readouterr().out
    # the rows: a chunk of the budget ending at the context, or a smaller one beside decode rows
    assert step_shapes(48, 80, 3)["mixed"][0].num_new == 45 and step_shapes(48, 80, 3)["prefill"][0].cache_len == 32
    for bad in ((96, 80, 3), (48, 80, 48)):
        with pytest.raises(ValueError):
            step_shapes(*bad)


def test_the_steps_chunk_writes_to_pages_of_its_own():
    """A chunk written to the profile's one scratch page contends on the same words (INT2's key bits
    are set by atomics): the steps part gives the chunk's row distinct pages inside the runner's pools,
    and leaves the decode rows on the scratch pages."""
    import math

    import torch

    from oscar_compile.bench.serve_models import build_model
    from oscar_compile.bench.serve_steps import own_pages, step_shapes
    from oscar_compile.runtime.worker.compressed_runner import CompressedRunner
    from oscar_compile.runtime.worker.memory_profile import profile_batch

    compressed, layout = build_model("tiny", "int2", 128, torch.device("cpu"))
    context = 96
    runner = CompressedRunner(compressed, layout, layout.num_window_pages_per_seq,
                              math.ceil(context / layout.page_size) + 1, max_seq_len=context + 1, max_num_seqs=4,
                              max_num_batched_tokens=48, cuda_graphs=False)
    batch = own_pages(profile_batch(runner, step_shapes(48, context, 3)["mixed"]))
    for table, scratch in ((batch.window_tables, runner.scratch_window), (batch.quant_tables, runner.scratch_quant)):
        assert len(set(table[0])) == len(table[0]) and all(0 <= p < scratch for p in table[0])
        assert all(p == scratch for row in table[1:] for p in row)
    runner.run(batch)
