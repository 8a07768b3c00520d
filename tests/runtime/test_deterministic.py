"""Deterministic mode (issue 31, item 4): a request's logprobs are bitwise the same alone, in a
batch, joining a running batch and (on the CPU) prefilled in chunks beside other requests' decode
steps.

The bundled model, as served (oscar-int2 with its shipped rotations, and the BF16 mode), prefix
caching off (a hit past the sink reads the shared prefix quantized: another semantics, item 2;
hits at the sink and swap preemption are tested on the CPU at the end, and so are the exact hits
past the sink of decode-consistent prefill, at window snapshots). Three
prompts: one within the sink + recent windows (320 tokens) and two with INT2 history. With
128-token steps the prompts prefill in staged chunks while the shorter ones decode, so every row
meets other batch shapes than alone. In the default mode these cases differ in the last bits
(issue 31: up to 9e-4 in float32); the test requires equality. The GPU variant (marker ``gpu``)
runs the same cases with CUDA graphs, chunking aside.

Both prefill semantics run these cases on the CPU: prompt-exact, and decode-consistent (the
default), whose reference attends in deterministic mode by fixed key blocks at absolute
positions (kernels/attention/prefill/attention_decode_consistent_ref.py), so a row's bits do not depend on its
chunk. Under decode-consistent the cases a prompt-exact engine cannot make exact hold too: a
resend hitting a window snapshot past the sink, and recompute preemption.
"""

from __future__ import annotations

import numpy as np
import pytest

from oscar_compile.loading import BUNDLED_MODEL_DIR
from oscar_compile.runtime import LLM, EngineConfig, SamplingParams
from oscar_compile.spec import specs_dir

pytestmark = pytest.mark.skipif(not (BUNDLED_MODEL_DIR / "config.json").exists(), reason="no bundled model")
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)


def _prompts() -> list[list[int]]:
    ids = np.fromfile(BUNDLED_MODEL_DIR / "heldout.bin", dtype=np.uint16)[:6000].astype(int).tolist()
    return [ids[0:200], ids[1000:1400], ids[3000:3450]]


def _llm(spec: str, device: str = "cpu", **config) -> LLM:
    rotations = BUNDLED_MODEL_DIR / "rotations" / f"{spec}.safetensors"
    cfg = EngineConfig(**{"deterministic": True, "kv_memory_gb": 0.25, "enable_prefix_caching": False, **config})
    return LLM(
        str(BUNDLED_MODEL_DIR),
        spec=str(specs_dir() / f"{spec}.yaml"),
        rotations=str(rotations) if rotations.exists() else None,
        device=device,
        config=cfg,
    )


def _results(requests) -> list[tuple[list[int], list[float]]]:
    """Per request (``LLM.generate``'s ``RequestOutput``, one choice): its tokens and logprobs."""
    return [(r.outputs[0].token_ids, [lp.logprob for lp in r.outputs[0].logprobs]) for r in requests]


def _joined(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """The first prompt decodes alone for 3 steps, then the others join (their prefill beside its
    decode rows: mixed steps, eager launches, where alone it replays CUDA graphs on a GPU)."""
    engine = llm.engine
    seqs = [engine.add_request(prompts[0], PARAMS)]
    got = {seqs[0].request_id: ([], [])}
    for _ in range(3):
        _collect(engine.step(), got)
    for p in prompts[1:]:
        seqs.append(engine.add_request(p, PARAMS))
        got[seqs[-1].request_id] = ([], [])
    while engine.has_unfinished():
        _collect(engine.step(), got)
    return [got[s.request_id] for s in seqs]


def _collect(deltas, got) -> None:
    for delta in deltas:
        tokens, logprobs = got[delta.request_id]
        tokens += delta.new_token_ids
        logprobs += [lp.logprob for lp in delta.new_logprobs]


@pytest.fixture(scope="module")
def engines() -> dict:
    """Engines without prefix caching, built once a module by ``_shared``: they keep no state
    between ``generate`` calls that another call could read."""
    return {}


def _shared(engines: dict, spec: str, device: str = "cpu", **config) -> LLM:
    key = (spec, device, *sorted(config.items()))
    if key not in engines:
        engines[key] = _llm(spec, device, **config)
    return engines[key]


def check_batch_invariance(engines: dict, spec: str, device: str, chunked: bool, **config) -> None:
    """Alone (one at a time), together (one prefill step), joining a running batch and, with
    ``chunked``, in 128-token steps on a fresh engine: the same tokens and logprobs, bitwise."""
    prompts = _prompts()
    llm = _shared(engines, spec, device, **config)
    alone = [_results(llm.generate([p], PARAMS))[0] for p in prompts]
    assert _results(llm.generate(prompts, PARAMS)) == alone
    assert _joined(llm, prompts) == alone
    if chunked:
        chunks = _llm(spec, device, max_num_batched_tokens=128, **config)
        assert _results(chunks.generate(prompts, PARAMS)) == alone


# (the BF16 mode quantizes nothing: both semantics are one computation there)
@pytest.mark.parametrize("spec,semantics", [("oscar-int2", "prompt-exact"), ("oscar-int2", "decode-consistent"),
                                            ("bf16", "decode-consistent")])
def test_logprobs_are_bitwise_the_same_alone_together_joined_and_chunked(engines, spec, semantics):
    check_batch_invariance(engines, spec, "cpu", chunked=True, prefill_semantics=semantics)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["oscar-int2", "bf16"])
def test_on_the_gpu_logprobs_are_bitwise_the_same_alone_together_and_joined(engines, spec):
    """CUDA graphs on (decode alone replays them; a mixed step launches eagerly). Chunked prefill
    is not part of the GPU promise: the kernels read a chunk's own keys in other blocks than the
    cached ones (README, "Deterministic mode")."""
    check_batch_invariance(engines, spec, "cuda", chunked=False, prefill_semantics="prompt-exact")


@pytest.mark.parametrize("semantics", ["prompt-exact", "decode-consistent"])
def test_resent_and_after_a_preemption_bitwise(semantics):
    """Prompt-exact: a resend whose prefix hits stop at the sink (``prefix_hits="sink"``: the rest
    is recomputed, staged) and a sequence swapped out and back (its pages return as they were); a
    recompute of a sequence that had generated tokens is another computation there (README,
    "Preemption by swapping") and is not part of its promise. Decode-consistent: a resend whose
    hits resume at window snapshots past the sink and window (the default ``prefix_hits``), and
    preemption by recompute (no swap space), generated tokens included."""
    prompts = _prompts()
    exact = semantics == "prompt-exact"
    # 20 tokens: under ``tight`` the 450-token prompt is preempted after its 14th (both semantics)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)
    hits = dict(prefix_hits="sink") if exact else {}
    llm = _llm("oscar-int2", enable_prefix_caching=True, prefill_semantics=semantics, **hits)
    alone = [_results(llm.generate([p], params))[0] for p in prompts]
    resent = llm.generate(prompts, params)  # every prompt hits its own pages
    assert _results(resent) == alone
    if not exact:
        assert max(o.num_cached_tokens for o in resent) > 64 + 256
    preempting = dict(num_window_pages=60, num_quant_pages=16, max_num_batched_tokens=128)
    tight = _llm("oscar-int2", prefill_semantics=semantics, **preempting, **({} if exact else {"swap_space_gb": 0}))
    assert _results(tight.generate(prompts, params)) == alone
    stats = tight.engine.stats()
    assert stats["num_swap_preemptions" if exact else "num_recompute_preemptions"] >= 1


def test_the_engine_config_reaches_the_runner(engines):
    llm = _shared(engines, "oscar-int2", prefill_semantics="prompt-exact")  # (built by the test above)
    assert llm.engine.runner.deterministic


def test_the_serve_flag_sets_the_engine_config():
    from oscar_compile.cli.serve import engine_config, parse_args

    assert engine_config(parse_args(["--deterministic"])).deterministic
    assert not engine_config(parse_args([])).deterministic


def test_decode_consistent_hits_at_window_snapshots_bitwise():
    """Under decode-consistent prefill a hit past the sink resumes at a BF16 window snapshot
    (runtime/core/window_snapshots.py): S0 = 64, W = 256, P = 16 here. A 450-token prompt resent
    resumes at 448; a prompt sharing its first 400 tokens with an earlier one resumes at 384 (the
    last multiple of the 128-token interval in the shared part). Each equals itself alone on an
    engine that holds none of its prefix (one engine for both: they share none), bitwise."""
    config = dict(enable_prefix_caching=True, prefill_semantics="decode-consistent", max_num_batched_tokens=128,
                  snapshot_interval=128)
    ids = np.fromfile(BUNDLED_MODEL_DIR / "heldout.bin", dtype=np.uint16)[:6000].astype(int).tolist()
    resent, stem = ids[3000:3450], ids[100:500]
    first, second = stem + ids[600:650], stem + ids[900:960]
    fresh = _llm("oscar-int2", **config)  # the two share no prefix: each runs as on a fresh engine
    alone = fresh.generate([resent], PARAMS) + fresh.generate([second], PARAMS)
    assert [o.num_cached_tokens for o in alone] == [0, 0]
    alone = _results(alone)
    llm = _llm("oscar-int2", **config)
    for prompt in (resent, first):
        llm.generate([prompt], PARAMS)
    outputs = [llm.generate([prompt], PARAMS)[0] for prompt in (resent, second)]
    assert [o.num_cached_tokens for o in outputs] == [448, 384]
    assert _results(outputs) == alone
    assert llm.engine.stats()["window_snapshot_hits"] == 2
