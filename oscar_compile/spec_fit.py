"""Fit a compression spec to one model: the check every entry point runs before any work.

A spec is written once and used on many models (``specs/*.yaml`` ship for every supported
family), but whether it fits depends on the model: a quantization group must divide the head
dim, an override must name a layer the model has. Checking this in each command let
``oscar-compile calibrate`` accept a spec that the server then refused, so the check lives
here, once, with one message, and ``calibrate``, ``apply``, ``compress`` / ``LLM``, the CLI and
the server all call it (the library verbs too, so a user calling them directly gets the same).

Fitting also resolves the one model-dependent default: a ``group_size`` larger than the head
dim becomes the head dim (one group per head row), so ``group_size: 128`` works on head dims of
64, 80 and 96 as well as 128 and 256. Fitting is idempotent, and the fitted spec is the one a
rotation artifact records. Torch-free: it reads two integers of the model.
"""
from __future__ import annotations

from typing import Optional

from .spec import CompressionSpec, SpecError


class SpecDoesNotFitModel(SpecError):
    """The spec is valid on its own but cannot be applied to this model; lists every reason."""


def _cap_group(kv, head_dim: int):
    if kv is None or kv.group_size is None or kv.group_size <= head_dim:
        return kv
    return kv.model_copy(update={"group_size": head_dim})


def fit_spec(spec: CompressionSpec, head_dim: int, num_layers: int, model: Optional[str] = None) -> CompressionSpec:
    """``spec`` resolved for a model of ``num_layers`` layers with ``head_dim`` channels per head.

    Raises :class:`SpecDoesNotFitModel` (a ``ValueError``) naming the model and every layer that
    cannot be stored as asked; returns the spec with group sizes capped at the head dim.
    """
    what = f"{model or 'the model'} (head_dim {head_dim}, {num_layers} layers)"
    problems = []
    for i, override in enumerate(spec.layers):
        for m in override.match:
            if not -num_layers <= m < num_layers:
                problems.append(f"layers[{i}].match: layer {m} out of range for a model of {num_layers} layers")
    layers = [o.model_copy(update={"kv_cache": _cap_group(o.kv_cache, head_dim)}) for o in spec.layers]
    fitted = spec.model_copy(update={"kv_cache": _cap_group(spec.kv_cache, head_dim), "layers": layers})
    if not problems:
        for index in range(num_layers):
            kv = fitted.for_layer(index, num_layers).kv_cache
            if kv.bits == 16:
                continue
            if head_dim % kv.group_size:
                problems.append(f"layer {index}: group_size {kv.group_size} does not divide head_dim {head_dim}")
            elif (head_dim * kv.bits) % 8:
                problems.append(f"layer {index}: head_dim {head_dim} x {kv.bits} bits is not a whole number of bytes")
    if problems:
        raise SpecDoesNotFitModel(f"the compression spec does not fit {what}:\n  " + "\n  ".join(problems))
    return fitted


def fit_spec_to_model(spec: CompressionSpec, model) -> CompressionSpec:
    """:func:`fit_spec` for a loaded model or a Hugging Face config (what the entry points hold)."""
    from .architectures import ModelFingerprint

    fp = ModelFingerprint.of(model)
    return fit_spec(spec, fp.head_dim, fp.num_layers, fp.architecture)


def fit_spec_to_model_dir(spec: CompressionSpec, model_dir) -> CompressionSpec:
    """:func:`fit_spec` from a model directory's ``config.json``: the commands check before loading weights."""
    from transformers import AutoConfig

    return fit_spec_to_model(spec, AutoConfig.from_pretrained(model_dir))


__all__ = ["SpecDoesNotFitModel", "fit_spec", "fit_spec_to_model", "fit_spec_to_model_dir"]
