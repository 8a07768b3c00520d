"""The benchmarks' models and step timing: random-weight Qwen3 shapes rewritten for the INT2 and
the BF16 mode, and a runner's eager step timed and released (``bench.serve`` and its parts).

Apart from ``bench/serve.py`` so that its parts' modules (``serve_steps``) read them without
importing the benchmark that runs them.
"""
from __future__ import annotations

import gc
import statistics
import time

import torch

from oscar_compile.passes import apply
from oscar_compile.runtime.worker.compressed_runner import CompressedRunner, compressed_layout
from oscar_compile.runtime.worker.runner import Batch
from oscar_compile.spec import shipped_spec

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, vocab_size=151936),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, vocab_size=151936),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=512),
}
HEADS = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128)
TINY_HEADS = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128)
MODES = {"int2": "hadamard-int2", "bf16": "bf16"}


def random_model(shape: str, max_len: int, device: torch.device, seed: int = 0, vocab_size: int | None = None):
    """A random-weight Qwen3 of ``shape`` (bfloat16 on CUDA, float32 on CPU), with the shape's
    vocabulary unless ``vocab_size`` is given."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = TINY_HEADS if shape == "tiny" else HEADS
    sizes = {**SHAPES[shape], **({"vocab_size": vocab_size} if vocab_size else {})}
    config = Qwen3Config(**sizes, **heads, max_position_embeddings=max_len, tie_word_embeddings=False)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    return model


def mode_spec(shape: str, mode: str):
    spec = shipped_spec(MODES[mode])
    if shape == "tiny":  # windows that fit the smoke run's short contexts
        spec = spec.model_copy(update={"kv_cache": spec.kv_cache.model_copy(update={"sink_tokens": 16,
                                                                                      "recent_tokens": 32})})
    return spec


def build_model(shape: str, mode: str, max_len: int, device: torch.device, fuse: bool = True, prepare=None):
    """A random-weight Qwen3 of ``shape``, rewritten for ``mode``; returns (the handle ``apply``
    returned, layout).
    ``prepare(model)`` runs before the rewrite (serve_tp.py keeps a rank's slice there)."""
    from oscar_compile.calibration import calibrate
    from oscar_compile.spec_fit import fit_spec_to_model

    model = random_model(shape, max_len, device)
    if prepare is not None:
        prepare(model)
    spec = fit_spec_to_model(mode_spec(shape, mode), model)  # once: calibrate, apply and the layout take it
    compressed = apply(model, spec, calibrate(model, spec), fuse=fuse)
    return compressed, compressed_layout(model, spec)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_time_s(runner: CompressedRunner, batch: Batch, reps: int) -> float:
    """Median wall time of one step of ``batch`` (after a warm-up that compiles the kernels)."""
    runner.run(batch)
    sync(runner.device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        runner.run(batch)
        sync(runner.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def release(runner: CompressedRunner) -> None:
    """Free a runner's pools and graphs now (the runner and its graphs refer to each other)."""
    runner.graphs = runner.pools = None
    gc.collect()
    empty_cache(runner.device)


def empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
