"""Tensor parallelism on the CPU: 2 ranks over gloo, the bundled model, against one process.

Greedy output with the model split over 2 processes must equal the unsplit model's token for
token (INT2 and BF16 modes, concurrent requests, preemption, prefix hits, staged prefills: the INT2
case runs the prompt-exact prefill semantics, whose staging it covers; the forked-choices case runs
the default, decode-consistent, with window snapshots); the
split must refuse what it cannot run before starting any process; a rank that dies mid-request
must fail the request and stop the engine within a bounded time. Each two-rank engine costs
about 10 s to start (two processes import torch and load the model), so each starts once.
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from oscar_compile.architectures import ModelFingerprint
from oscar_compile.artifact import ArtifactError, Rotations
from oscar_compile.loading import BUNDLED_MODEL_DIR
from oscar_compile.runtime import LLM, EngineConfig, SamplingParams
from oscar_compile.spec import shipped_spec, specs_dir
from oscar_compile.tensor_parallel.launch import check_launch
from oscar_compile.tensor_parallel.shard import check_divisible, check_rotations_layout, shard_rotations

sys.path.insert(0, str(Path(__file__).parents[1] / "runtime"))  # server_http, the server tests' HTTP helpers

_PREFIX, _TAIL, _MAX_TOKENS = 80, 12, 12


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # rank 0 shares 2 cores with rank 1
    yield
    torch.set_num_threads(previous)


def _small_windows(spec, **key):
    """Windows of 16 + 32 tokens: 100-token prompts then have history pages (INT2, prefix hits)."""
    kv = spec.kv_cache.model_copy(update={"sink_tokens": 16, "recent_tokens": 32})
    return spec.model_copy(update={"kv_cache": kv, "key": spec.key.model_copy(update=key)})


def _per_head_rotations() -> Rotations:
    """The bundled OSCAR rotations on KV head 0 and none (identity) on head 1, with per-head key
    means: a rank holding the other rank's slice quantizes its keys and values differently."""
    rot = Rotations.load(BUNDLED_MODEL_DIR / "rotations" / "oscar-int2.safetensors")
    gen = torch.Generator().manual_seed(0)
    eye = torch.eye(rot.k[0].shape[-1])
    k = [torch.stack([r[0], eye]) for r in rot.k]
    v = [torch.stack([r[0], eye]) for r in rot.v]
    extras = [{"k_mean": 0.5 * torch.randn(r.shape[:2], generator=gen)} for r in rot.k]
    return Rotations(spec=rot.spec, fingerprint=rot.fingerprint, k=k, v=v, extras=extras)


def _swapped_heads(rot: Rotations) -> Rotations:
    """What every rank would hold if each took the other's slice."""
    flip = lambda ts: [t.flip(0).contiguous() for t in ts]  # noqa: E731
    extras = [{name: t.flip(0).contiguous() for name, t in e.items()} for e in rot.extras]
    return Rotations(spec=rot.spec, fingerprint=rot.fingerprint, k=flip(rot.k), v=flip(rot.v), extras=extras)


def _prompts() -> list[list[int]]:
    """Five prompts, three sharing an 80-token prefix (prefix-cache hits) behind one other."""
    ids = np.fromfile(BUNDLED_MODEL_DIR / "heldout.bin", dtype=np.uint16)[:2000].astype(int).tolist()
    prefix = ids[:_PREFIX]
    return ([ids[1000:1000 + _PREFIX + _TAIL]] + [prefix + ids[200 + 50 * i:200 + 50 * i + _TAIL] for i in range(3)]
            + [ids[1500:1530]])


def _config(swap_bytes: int, **kw) -> EngineConfig:
    """Few pages: 5 concurrent requests preempt each other (one swapped, one recomputed once the
    swap space is full); a 64-token step budget prefills 92-token prompts in staged chunks."""
    base = dict(num_window_pages=12, num_quant_pages=10, max_num_seqs=4, max_num_batched_tokens=64,
                swap_space_gb=swap_bytes / 1024**3)
    return EngineConfig(**{**base, **kw})


def _per_rank(config: EngineConfig, world_size: int) -> EngineConfig:
    """The same engine split over ``world_size`` ranks: the same page counts, and host swap space
    for the same sequences (a rank's pages hold its share of the KV heads, so it swaps fewer bytes)."""
    return dataclasses.replace(config, swap_space_gb=config.swap_space_gb / world_size)


def _run(llm: LLM) -> tuple[list[list[int]], list[list[float]], dict]:
    params = SamplingParams(max_tokens=_MAX_TOKENS, temperature=0, logprobs=0, ignore_eos=True)
    outs = [o.outputs[0] for o in llm.generate(_prompts(), params)]
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs], llm.engine.stats()


def _generate_both(spec, rotations, config: EngineConfig):
    one = LLM(None, spec, rotations, device="cpu", config=config)
    single = _run(one)
    with LLM(None, spec, rotations, device="cpu", config=_per_rank(config, 2), tensor_parallel_size=2) as two:
        split = _run(two)
    return single, split


def _assert_equal_and_exercised(single, split, staged: bool = True):
    (tokens1, logprobs1, stats1), (tokens2, logprobs2, stats2) = single, split
    assert tokens2 == tokens1
    # the sums of the two ranks' o_proj / down_proj halves round differently from one product
    np.testing.assert_allclose(np.concatenate(logprobs2), np.concatenate(logprobs1), atol=2e-3)
    for stats in (stats1, stats2):  # the paths the equality has to hold through were taken
        assert stats["num_swap_preemptions"] > 0 and stats["num_recompute_preemptions"] > 0, stats
        assert stats["prefix_cache_hit_tokens"] > 0 and (stats["num_staged_prefills"] > 0) == staged, stats
    assert stats2["tensor_parallel_size"] == 2 and stats1["kv_bytes_per_rank"] == 2 * stats2["kv_bytes_per_rank"]


def test_int2_split_over_two_ranks_equals_one_with_per_head_rotations():
    spec = _small_windows(shipped_spec("oscar-int2"), center=True)
    rotations = _per_head_rotations()
    config = _config(swap_bytes=3 * 262144 + 6 * 9216,  # one sequence: 3 window pages, 6 history pages
                     prefill_semantics="prompt-exact")  # staged prefills and history hits
    single, split = _generate_both(spec, rotations, config)
    _assert_equal_and_exercised(single, split)
    # a wrong slice (each rank the other's KV head rotations and means) changes the output
    with LLM(None, spec, _swapped_heads(rotations), device="cpu", config=config) as wrong:
        tokens, logprobs, _ = _run(wrong)
    assert tokens != single[0] or np.abs(np.concatenate(logprobs) - np.concatenate(single[1])).max() > 5e-2


def test_bf16_split_over_two_ranks_equals_one():
    config = _config(swap_bytes=8 * 196608, num_window_pages=0, num_quant_pages=18)  # 8 pages of 16 BF16 tokens
    single, split = _generate_both(shipped_spec("bf16"), None, config)
    _assert_equal_and_exercised(single, split, staged=False)


def test_forked_choices_split_over_two_ranks_equal_one():
    """n = 3: every rank copies the forked choices' window pages and partial history page."""
    spec = _small_windows(shipped_spec("hadamard-int2"))  # (its rotations need no data)
    config = EngineConfig(num_window_pages=12, num_quant_pages=20, max_num_seqs=4)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=3, ignore_eos=True)
    prompt = _prompts()[0][:70]  # history 22 tokens: a full page shared, a partial one copied
    with LLM(None, spec, None, device="cpu", config=config) as one:
        (request,) = one.generate(prompt, params)
        single = [c.token_ids for c in request.outputs]
        assert one.engine.stats()["fork_quant_pages_copied"] == 2
    with LLM(None, spec, None, device="cpu", config=config, tensor_parallel_size=2) as two:
        assert [c.token_ids for c in two.generate(prompt, params)[0].outputs] == single
    assert len({tuple(t) for t in single}) == 3


def test_the_server_reports_each_rank_and_fails_loudly_in_bounded_time_when_a_rank_dies(capsys):
    import multiprocessing
    import threading

    from server_http import get, post, running

    from oscar_compile.cli import serve

    args = serve.parse_args(["--device", "cpu", "--spec", str(specs_dir() / "bf16.yaml"), "--kv-memory", "0.01",
                             "--tensor-parallel-size", "2", "--no-prefix-caching"])
    app, name = serve.app_from_args(args)
    try:
        with running(app) as port:
            status, text = get(port, "/metrics")
            assert status == 200 and "oscar_tensor_parallel_size 2" in text
            assert 'oscar_kv_rank_pages_total{kind="quant",rank="1"}' in text
            victim = next(p for p in multiprocessing.active_children() if p.name == "oscar-tp-rank1")
            reply = {}
            body = {"model": name, "prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True}
            request = threading.Thread(target=lambda: reply.update(r=post(port, "/v1/completions", body)))
            start = time.monotonic()
            request.start()
            while time.monotonic() - start < 30 and request.is_alive():  # mid-request: steps have run
                if "oscar_generation_tokens_total 0.0\n" not in get(port, "/metrics")[1]:
                    break
                time.sleep(0.05)
            assert request.is_alive(), reply
            os.kill(victim.pid, signal.SIGKILL)
            request.join(60)
            assert not request.is_alive() and time.monotonic() - start < 60
            status, payload = reply["r"]
            assert status == 503 and re.search("rank 1 .* exited with code -9", payload["error"]["message"])
            assert get(port, "/health")[0] == 503  # the engine stopped: no later request can run
            assert post(port, "/v1/completions", {"model": name, "prompt": [5], "max_tokens": 1})[0] == 503
    finally:
        app.state.tensor_parallel.close()


def test_serve_refuses_a_split_that_cannot_run(capsys):
    from oscar_compile.cli import serve

    assert serve.main(["--device", "cpu", "--tensor-parallel-size", "3"]) == 2
    assert "does not divide the model's 2 KV heads" in capsys.readouterr().err


def test_what_cannot_be_split_is_refused_before_any_process_starts():
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(BUNDLED_MODEL_DIR)
    with pytest.raises(ValueError, match="does not divide the model's 2 KV heads"):
        check_divisible(config, 3)
    with pytest.raises(ValueError, match="does not divide the model's 2 KV heads"):
        LLM(None, shipped_spec("bf16"), device="cpu", tensor_parallel_size=4)
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="needs one CUDA device per rank"):
            check_launch(config, 2, torch.device("cuda"))
    rot = Rotations.load(BUNDLED_MODEL_DIR / "rotations" / "oscar-int2.safetensors")
    other = dataclasses.replace(ModelFingerprint.of(config), num_kv_heads=1, num_heads=3)
    with pytest.raises(ArtifactError, match="another head layout"):
        check_rotations_layout(rot, other)
    with pytest.raises(ArtifactError, match="num_kv_heads"):
        check_rotations_layout(shard_rotations(rot, 0, 2), ModelFingerprint.of(config))  # an already split file
    with pytest.raises(ValueError, match="pass a model directory"):
        LLM(torch.nn.Linear(1, 1), shipped_spec("bf16"), tokenizer=object(), tensor_parallel_size=2)


def test_rotations_are_sliced_by_kv_head():
    rot = _per_head_rotations()
    for rank in range(2):
        part = shard_rotations(rot, rank, 2)
        assert part.fingerprint.num_kv_heads == 1 and part.fingerprint.num_heads == 3
        for i in range(rot.num_layers):
            assert torch.equal(part.k[i][0], rot.k[i][rank]) and torch.equal(part.v[i][0], rot.v[i][rank])
            assert torch.equal(part.k_mean[i][0], rot.k_mean[i][rank])
    assert shard_rotations(rot, 0, 1) is rot


def _load_but_rank_1_exits(model_dir):
    """A ``RankSetup.load`` whose rank 1 dies while it loads (module level: spawned ranks import it)."""
    import torch.distributed as dist

    from oscar_compile.tensor_parallel.launch import load_model_dir

    if dist.get_rank() == 1:
        os._exit(3)
    return load_model_dir(model_dir, torch.float32)


def test_a_rank_that_dies_while_starting_fails_the_start_at_once():
    from functools import partial

    from oscar_compile.runtime.worker.tp_runner import TensorParallelError
    from oscar_compile.tensor_parallel.launch import RankSetup, TensorParallelGroup, free_port, join_group

    # before it checks in: rank 0 stops waiting for it as soon as its process has ended
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 .* exited with code 3"):
        join_group(0, 2, free_port(), "cpu", 60, find_dead_rank=lambda: "rank 1 (pid 1) exited with code 3")
    assert time.monotonic() - start < 5
    # while it loads its slice: rank 0's first message to it fails, naming it
    setup = RankSetup(partial(_load_but_rank_1_exits, str(BUNDLED_MODEL_DIR)), shipped_spec("bf16"), None,
                      EngineConfig(num_window_pages=0, num_quant_pages=16), "cpu", timeout_s=60)
    group = TensorParallelGroup(setup, 2)
    try:
        model, _, config, make_runner = group.prepare()
        from oscar_compile.runtime.engine_config import build_engine

        with pytest.raises(TensorParallelError, match="rank 1 .* exited with code 3"):
            build_engine(model, None, config, make_runner=make_runner)
    finally:
        group.close()
