"""``evaluate(...)``: every method on the same held-out data in one run; table, JSON and plots.

Order of work: resolve the paths (refusing overlapping splits), load the model, build every
method's per-layer quantizers (loading or calibrating rotations), then the tasks (config.TASKS),
each running all methods on the same batch before moving on, so every number in a row of the
table comes from the same tokens.
"""
from __future__ import annotations

import datetime
import functools
import logging
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..architectures import ModelFingerprint
from ..kernels.determinism import deterministic
from ..loading import load_model, resolve_device
from .config import EvalConfig
from .heldout import bos_id, heldout_windows, read_tokens, resolve_paths
from .layer_metrics import LayerMetrics
from .methods import resolve_methods
from .needle_task import accuracy_by_length, needle_accuracy, needle_cases, pad_id
from .prepare import method_quantizers
from .report import write_outputs
from .tasks import agreement, batches, perplexity

logger = logging.getLogger(__name__)
FORMAT = "oscar_compile.eval"
FORMAT_VERSION = 1


def evaluate(config: EvalConfig | None = None, **settings) -> dict:
    """Run the comparison; returns the results dict (also written under ``out`` when given).

    Pass an :class:`EvalConfig` or its fields as keywords, e.g.
    ``evaluate(model="dir", specs=["bf16", "oscar-int2"], contexts=[1024], out="eval/results/x")``.
    """
    cfg = config if config is not None else EvalConfig(**settings)
    if config is not None and settings:
        raise TypeError("pass either an EvalConfig or keyword settings, not both")
    with deterministic(cfg.deterministic):  # batch-invariant linears and attention splits when asked
        return _evaluate(cfg)


def _evaluate(cfg: EvalConfig) -> dict:
    t0 = time.time()
    model_dir, data_path, calib_path = resolve_paths(cfg.model, cfg.data, cfg.calib)
    methods = resolve_methods(cfg.specs)  # fail on a bad name before loading anything
    device = resolve_device(cfg.device)
    model, tokenizer = load_model(model_dir, device, cfg.dtype, tokenizer_required=False)
    if tokenizer is None:
        logger.warning("no tokenizer in %s: needle-in-a-haystack is skipped", model_dir)
    bos = bos_id(model, tokenizer)
    calib_tokens = functools.lru_cache(maxsize=1)(lambda: read_tokens(calib_path, tokenizer))
    rot_dir = None if cfg.rotations_dir is None else Path(cfg.rotations_dir)
    save_dir = None if cfg.out_dir is None else cfg.out_dir / "rotations"
    quantizers, notes = {}, {}
    t_rot = time.time()
    for m in methods:
        quantizers[m.name], notes[m.name] = method_quantizers(model, m, rot_dir, calib_tokens, bos, save_dir,
                                                              cfg.progress, cfg.calib_tokens)
    tokens = read_tokens(data_path, tokenizer)
    fp = ModelFingerprint.of(model)
    results = _header(cfg, model_dir, data_path, calib_path, device, model, fp)
    results["timings_s"] = {"rotations": _done("rotations", t_rot)}
    results["methods"] = {m.name: {"source": m.source, "description": m.description, "rotations": notes[m.name],
                                   "reference": m.is_reference} for m in methods}
    results["bits_per_element"] = {
        m.name: {**{str(c): m.bits_per_element(fp.head_dim, fp.num_layers, c) for c in cfg.contexts},
                 "asymptotic": m.bits_per_element(fp.head_dim, fp.num_layers, None)} for m in methods}
    with torch.inference_mode():
        _run_tasks(cfg, model, tokenizer, tokens, bos, quantizers, results)
    results["runtime_s"] = time.time() - t0
    if cfg.out_dir is not None:
        results["files"] = write_outputs(results, cfg.out_dir)
    return results


def _header(cfg: EvalConfig, model_dir, data_path, calib_path, device, model, fp: ModelFingerprint) -> dict:
    import transformers

    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"format": FORMAT, "format_version": FORMAT_VERSION,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": str(model_dir), "fingerprint": asdict(fp), "data": str(data_path), "calib": str(calib_path),
            "device": f"{device} ({dev})", "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "settings": {k: v for k, v in cfg.to_dict().items() if k not in ("progress",)}}


def _run_tasks(cfg: EvalConfig, model, tokenizer, tokens: torch.Tensor, bos, quantizers: dict, results: dict) -> None:
    """Run the selected tasks in order, recording how long each took in ``results["timings_s"]``."""
    device = next(model.parameters()).device
    timings = results.setdefault("timings_s", {})
    if "layers" in cfg.tasks:
        t0 = time.time()
        T = cfg.layers_context
        windows = heldout_windows(tokens, T, cfg.num_samples, bos)
        metrics = LayerMetrics(model, quantizers, cfg.metric_queries)
        for ids in batches(windows, cfg.batch_size, cfg.progress, f"layer metrics @{T}"):
            metrics.add_batch(ids.to(device))
        results["layers"] = {"context": T, "scored_queries": cfg.metric_queries, "windows": windows.shape[0],
                             "metrics": metrics.results()}
        timings["layers"] = _done("layer metrics", t0)
    for task, fn, n in (("perplexity", perplexity, cfg.ppl_tokens), ("agreement", agreement, cfg.gen_tokens)):
        if task in cfg.tasks:
            t0 = time.time()
            results[task] = {"tokens": n}
            for c in cfg.contexts:
                windows = heldout_windows(tokens, c, cfg.num_samples, bos)
                results[task][str(c)] = fn(model, quantizers, windows, n, cfg.batch_size, cfg.progress,
                                           cfg.prefill_semantics)
            timings[task] = _done(task, t0)
    if "needle" in cfg.tasks and cfg.needle_per_cell > 0:
        t0 = time.time()
        results["needle"] = _needle(cfg, model, tokenizer, tokens, quantizers, bos)
        timings["needle"] = _done("needle", t0)


def _done(task: str, t0: float) -> float:
    elapsed = time.time() - t0
    logger.info("%s: %.1f s", task, elapsed)
    return elapsed


def _needle(cfg: EvalConfig, model, tokenizer, tokens: torch.Tensor, quantizers: dict, bos: int | None) -> dict:
    if tokenizer is None:
        return {"skipped": "the model directory has no tokenizer"}
    try:
        cases = needle_cases(tokenizer, tokens.numpy(), cfg.contexts, cfg.needle_depths, cfg.needle_per_cell, cfg.seed,
                             bos)
    except ValueError as err:
        logger.warning("needle-in-a-haystack skipped: %s", err)
        return {"skipped": str(err)}
    cells = needle_accuracy(model, quantizers, cases, cfg.needle_mode, cfg.batch_size, pad_id(tokenizer, model),
                            cfg.progress, cfg.prefill_semantics)
    return {"mode": cfg.needle_mode, "prefill_semantics": cfg.prefill_semantics, "layout": "plain",
            "lengths": sorted({c.sample.length for c in cases}),
            "depths": list(cfg.needle_depths), "per_cell": cfg.needle_per_cell, "cells": cells,
            "by_length": {name: {str(L): a for L, a in accuracy_by_length(c).items()} for name, c in cells.items()}}
