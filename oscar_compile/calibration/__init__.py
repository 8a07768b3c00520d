"""``calibrate(model, spec, batches) -> Rotations``: capture, accumulate, solve.

Streaming: the model runs over the batches with attention captured (capture.py), running sums
grow per layer (stats.py), and only the [H_kv, D, D] targets are kept. A second pass over the
same batches runs only when some layer's value rotation uses the score-weighted target, whose
token weights need the finished query covariance. So ``batches`` must be re-iterable (a list,
a tuple, or any iterable whose ``iter()`` starts over) in that case.
"""
from __future__ import annotations

import collections.abc
import logging
from collections.abc import Iterable

import torch
from torch import nn

from ..architectures import ModelFingerprint, architecture_of
from ..artifact import Rotations
from ..spec import CompressionSpec, LayerSpec
from ..spec_fit import fit_spec
from .capture import capture_attention
from .solve import solve_layer
from .stats import LayerStats

logger = logging.getLogger(__name__)

Batch = torch.Tensor | dict


def _needs_data(layer: LayerSpec) -> bool:
    return layer.key.rotation in ("oscar", "optr") or layer.value.rotation in ("oscar", "optr") or layer.key.center


def _needs_value_pass(layer: LayerSpec) -> bool:
    return layer.value.rotation in ("oscar", "optr") and layer.value.target == "score_weighted"


def _uses_optr(layer: LayerSpec) -> bool:
    return "optr" in (layer.key.rotation, layer.value.rotation) and layer.quantized


def _keep_trace(into: list, q, k, v, mask, num_queries: int) -> None:
    """Keep, on the CPU, every fully unpadded sequence of the batch long enough for OptR's loss."""
    T = k.shape[2]
    if T <= num_queries:
        return
    rows = range(k.shape[0]) if mask is None else [b for b in range(k.shape[0]) if bool(mask[b].all())]
    for b in rows:
        into.append((q[b, :, -num_queries:].float().cpu(), k[b].float().cpu(), v[b].float().cpu()))


def _refine_with_optr(model, spec: CompressionSpec, layers, solved, traces, progress: bool) -> None:
    """Replace the base rotations of optr layers by their OptR refinements (in ``solved``)."""
    from ..architectures import attention_modules
    from .optr import LayerTraces, refine_layer

    modules = attention_modules(model)
    todo = [i for i, layer in enumerate(layers) if _uses_optr(layer)]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc="calibrate: OptR refinement", unit="layer")
    for i in todo:
        seqs = traces[i]
        if not seqs:
            raise ValueError(f"OptR needs calibration sequences longer than optr.num_queries ({spec.optr.num_queries})")
        lengths = [s[1].shape[1] for s in seqs]
        T = max(set(lengths), key=lengths.count)  # positions must line up: use the most common length
        seqs = [s for s in seqs if s[1].shape[1] == T]
        q, k, v = (torch.stack([s[j] for s in seqs]) for j in range(3))
        attn = modules[i]
        data = LayerTraces(q, k, v, attn.o_proj.weight.detach().float().cpu(), float(attn.scaling))
        mean = solved[i].extras.get("k_mean") if layers[i].key.center else None
        with torch.enable_grad():
            solved[i].k, solved[i].v = refine_layer(data, layers[i], solved[i].k, solved[i].v, mean, spec.optr)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()


def _unpack(batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A batch is token ids [B, T] or a dict with ``input_ids`` (and optionally ``attention_mask``)."""
    if isinstance(batch, dict):
        if "input_ids" not in batch:
            raise TypeError("a calibration batch dict needs an 'input_ids' entry")
        ids, mask = batch["input_ids"], batch.get("attention_mask")
    else:
        ids, mask = batch, None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise TypeError(f"calibration batches must be token-id tensors [B, T]; got {type(ids).__name__}"
                        f"{'' if not isinstance(ids, torch.Tensor) else ' of shape ' + str(tuple(ids.shape))}")
    return ids, None if mask is None else mask.bool()


def _input_device(model: nn.Module) -> torch.device:
    emb = model.get_input_embeddings().weight
    return emb.device if emb.device.type != "meta" else torch.device("cpu")


def _run_pass(model, batches, callback, token_mask_box, progress, description) -> None:
    device = _input_device(model)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        total = len(batches) if isinstance(batches, collections.abc.Sized) else None
        bar = tqdm(total=total, desc=description, unit="batch")
    with torch.no_grad(), capture_attention(model, callback):
        for batch in batches:
            ids, mask = _unpack(batch)
            token_mask_box[0] = mask
            kwargs = {"attention_mask": mask.long().to(device)} if mask is not None else {}
            model(input_ids=ids.to(device), use_cache=False, **kwargs)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()


def calibrate(
    model: nn.Module,
    spec: CompressionSpec,
    batches: Iterable[Batch] | None = None,
    progress: bool = False,
) -> Rotations:
    """Calibrate the rotations ``spec`` asks for on ``model`` (a supported HF causal LM).

    batches: token ids [B, T] (or dicts with ``input_ids`` and an optional ``attention_mask``;
    masked tokens are left out of every statistic). ``none`` and ``hadamard`` rotations need
    no data (``batches`` may be None then). The model's outputs are not changed.
    """
    architecture_of(model)  # refuse unknown architectures before any work
    fp = ModelFingerprint.of(model)
    spec = fit_spec(spec, fp.head_dim, fp.num_layers, fp.architecture)  # before any work
    layers = [spec.for_layer(i, fp.num_layers) for i in range(fp.num_layers)]
    stats = [LayerStats(fp.num_kv_heads, fp.head_dim) for _ in layers]
    if any(_needs_data(layer) for layer in layers):
        if batches is None:
            raise ValueError("this spec calibrates from data (oscar rotation or key centring): pass batches")
        if isinstance(batches, collections.abc.Iterator) and any(_needs_value_pass(layer) for layer in layers):
            raise TypeError(
                "score-weighted value calibration reads the data twice: pass a list (or another "
                "re-iterable) of batches, not a one-shot iterator/generator"
            )
        was_training = model.training
        model.eval()
        token_mask: list = [None]

        traces = {i: [] for i, layer in enumerate(layers) if _uses_optr(layer)}

        def first_pass(layer, q, k, v, out):
            stats[layer].add(q, k, out, token_mask[0])
            if layer in traces:
                _keep_trace(traces[layer], q, k, v, token_mask[0], spec.optr.num_queries)

        def value_pass(layer, q, k, v, out):
            if _needs_value_pass(layers[layer]):
                stats[layer].add_value_weights(k, v, token_mask[0])

        try:
            _run_pass(model, batches, first_pass, token_mask, progress, "calibrate: queries, keys")
            if any(_needs_value_pass(layer) for layer in layers):
                _run_pass(model, batches, value_pass, token_mask, progress, "calibrate: score-weighted values")
        finally:
            model.train(was_training)
        logger.info("calibrated on %d tokens", stats[0].num_tokens)
    solved = [solve_layer(layer, s, fp) for layer, s in zip(layers, stats, strict=True)]
    if any(_uses_optr(layer) for layer in layers):
        _refine_with_optr(model, spec, layers, solved, traces, progress)
    return Rotations(
        spec=spec,
        fingerprint=fp,
        k=[r.k for r in solved],
        v=[r.v for r in solved],
        num_tokens=stats[0].num_tokens,
        extras=[r.extras for r in solved],
    )


__all__ = ["calibrate"]
