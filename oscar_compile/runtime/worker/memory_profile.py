"""The profile run on CUDA: what the device holds at the largest step, for the KV budget.

A runner built with one sequence's pages (the engine's profile page manager) captures its CUDA
graphs and compiles its kernels as the real one will, then runs the largest step the config
allows (``core.memory_plan.largest_step``) with every row's prompt logits on: the model's
activations at ``max_num_batched_tokens``, the logits of every token in fp32, their scoring
(``score_tokens``'s log-softmax and top-k), the extend scratch or the decode-consistent views
of the longest context, and a sampling pass with logprobs, top-k / top-p and a grammar bitmask.
Every page the step names is a scratch page (the values are garbage: only the memory counts).
The allocator's peak and the device's free memory then give ``MemoryProfile``; the runner is
freed before the real one is built. Under tensor parallelism every rank runs this in lockstep
(the forward all-reduces); rank 0 alone scores and samples, as it does when serving.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence

import torch

from oscar_compile.runtime.core.memory_plan import GIB, InsufficientMemoryError, MemoryProfile, StepRow
from oscar_compile.runtime.core.sampling_params import MAX_LOGPROBS, SamplingParams
from oscar_compile.runtime.worker.logprobs import score_tokens
from oscar_compile.runtime.worker.runner import Batch
from oscar_compile.runtime.worker.sampler import Sampler

logger = logging.getLogger(__name__)


def profile_batch(runner, rows: Sequence[StepRow]) -> Batch:
    """The step of ``rows`` on the runner's scratch pages, every row's prompt logits asked for.
    ``runner``: a CompressedRunner (its layout, scratch page ids and table width)."""
    layout, P = runner.layout, runner.layout.page_size
    for row in rows:
        need = layout.num_quant_pages_for(layout.num_history_tokens(row.cache_len + row.num_new))
        if need > runner.quant_width:
            raise ValueError(f"a profile row of {row.cache_len + row.num_new} tokens needs {need} history pages, "
                             f"the runner's tables hold {runner.quant_width} ({P} tokens each)")
    window = [runner.scratch_window] * layout.num_window_pages_per_seq
    quant = [runner.scratch_quant] * runner.quant_width
    ends = [r.cache_len + r.num_new for r in rows]
    return Batch(seq_ids=[-1 - i for i in range(len(rows))], token_ids=[[0] * r.num_new for r in rows],
                 positions=[list(range(r.cache_len, end)) for r, end in zip(rows, ends, strict=True)],
                 cache_lens=[r.cache_len for r in rows],
                 history_lens=[layout.num_history_tokens(r.cache_len) for r in rows],
                 window_tables=[list(window) for _ in rows], quant_tables=[list(quant) for _ in rows],
                 context_token_ids=[[0] * end for end in ends], layout=layout,
                 logit_rows=tuple(range(len(rows))))


def pool_bytes(runner) -> int:
    """Bytes of a CompressedRunner's page pools (KV pages, staging pages, their scratch pages)."""
    pools = list(runner.pools) + [p for p in runner.staging_pools if p is not None]
    return sum(t.numel() * t.element_size() for layer in pools for t in layer)


def run_largest_step(runner, rows: Sequence[StepRow], score_prompts: bool, sample: bool) -> tuple[int, int]:
    """The step the profile measures: the forward with every row's logits, then (rank 0 of a
    serving engine) the prompt scoring and the sampler's pass, a grammar bitmask applied.
    Returns the logits' shape ``(B + N, V)`` (the rows' last tokens, then every token)."""
    batch = profile_batch(runner, rows)
    logits = runner.run(batch)  # [B + N, V] float32
    shape = tuple(logits.shape)
    B = batch.num_seqs
    on_cuda = runner.device.type == "cuda"
    if score_prompts:  # gathered per block, as a chunk that ends its prompt is (model_worker)
        num_scored = shape[0] - B
        score_tokens(logits[B:], [0] * num_scored, MAX_LOGPROBS, rows=list(range(num_scored)))
        logits = logits[:B].clone()  # what a scoring step keeps while it is in flight
    if sample:
        words = -(-logits.shape[1] // 32)
        bitmask = torch.full((B, words), -1, dtype=torch.int32, pin_memory=on_cuda)  # every token allowed
        params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=MAX_LOGPROBS)] * B
        Sampler().sample(logits[:B], params, [0] * B, [r.cache_len + r.num_new for r in rows],
                         None, bitmask).result()
    if on_cuda:
        torch.cuda.synchronize(runner.device)
    return shape


def weight_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of the model's parameters and buffers on ``device`` (shared storages counted once)."""
    storages = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device == device:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def measure_step_memory(build: Callable[[], object], rows: Sequence[StepRow], device: torch.device,
                        weights: int, score_prompts: bool = True, sample: bool = True) -> MemoryProfile:
    """Build a profile runner (``build()``: one sequence's pages), run the largest step of
    ``rows`` on it and measure; the runner is freed before this returns. ``weights``: the bytes
    of the model on ``device`` (:func:`weight_bytes`), already loaded."""
    _release(device)
    free, total = torch.cuda.mem_get_info(device)
    before = total - free
    torch.cuda.reset_peak_memory_stats(device)
    runner = None
    try:
        runner = build()
        run_largest_step(runner, rows, score_prompts, sample)
        free, total = torch.cuda.mem_get_info(device)
        # the allocator's reserve at its peak, instead of what it holds now: the step's transient
        # tensors are freed but were there at once
        peak_in_use = total - free - torch.cuda.memory_reserved(device) + torch.cuda.max_memory_reserved(device)
        pools = pool_bytes(runner)
        # (another process that freed memory meanwhile must not make the run look smaller than its pages)
        profile = MemoryProfile(total=total, before=before, peak_in_use=max(peak_in_use, before + pools),
                                profile_pools=pools, weights=min(weights, before))
    except torch.cuda.OutOfMemoryError as err:
        num_tokens = sum(r.num_new for r in rows)
        raise InsufficientMemoryError(
            f"GPU memory: the profile run of the largest step ({num_tokens} tokens over {len(rows)} sequences, the "
            f"longest at {max(r.cache_len + r.num_new for r in rows)} tokens of context, prompt logprobs on) ran out "
            "of memory beside the weights and the pages of one such sequence: lower --max-num-batched-tokens, "
            f"--max-num-seqs or --max-model-len ({err})") from err
    finally:
        del runner
        _release(device)
    logger.info("profile run: %.2f GiB in use before, %.2f GiB at the largest step's peak (%.2f GiB of it the "
                "profile runner's pages; weights %.2f GiB) of %.2f GiB", profile.before / GIB,
                profile.peak_in_use / GIB, profile.profile_pools / GIB, profile.weights / GIB, profile.total / GIB)
    return profile


def _release(device: torch.device) -> None:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
