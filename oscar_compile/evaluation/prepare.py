"""From a method to per-layer quantizers: load its rotation file or calibrate it on the fly.

Rotations come from ``<rotations_dir>/<method>.safetensors`` when that file exists (checked against
the model), otherwise from ``calibrate()`` on the calibration split with the spec's own
``calibration`` settings (streaming: a few forwards). Freshly calibrated rotations are saved under
``<out>/rotations/`` so a later run can reuse them with ``--rotations-dir``.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..architectures import ModelFingerprint
from ..artifact import Rotations
from ..calibration import calibrate
from ..calibration.tokens import make_batches
from ..spec import CompressionSpec
from ..spec_fit import fit_spec
from .kivi import KiviQuantizer
from .methods import Method
from .quantizers import LayerQuantizer, spec_quantizers

logger = logging.getLogger(__name__)


def _needs_data(spec: CompressionSpec, num_layers: int) -> bool:
    for i in range(num_layers):
        layer = spec.for_layer(i, num_layers)
        if layer.key.rotation in ("oscar", "optr") or layer.value.rotation in ("oscar", "optr") or layer.key.center:
            return True
    return False


def _check_artifact_spec(path: Path, method: Method, rot: Rotations) -> None:
    made = rot.spec
    for section in ("key", "value"):
        a, b = getattr(made, section), getattr(method.spec, section)
        if (a.rotation, a.granularity) != (b.rotation, b.granularity) or \
                (section == "value" and a.target != b.target) or (section == "key" and a.center != b.center):
            logger.warning("%s: made for %s %s, method %s asks for %s %s: evaluating the file's rotations",
                           path, section, a.model_dump(), method.name, section, b.model_dump())


def capped_spec(spec: CompressionSpec, max_tokens: int | None) -> CompressionSpec:
    """The spec with ``calibration.num_tokens`` (and ``seq_len``) capped at ``max_tokens``."""
    cal = spec.calibration
    if max_tokens is None or cal.num_tokens <= max_tokens:
        return spec
    cal = cal.model_copy(update={"num_tokens": max_tokens, "seq_len": min(cal.seq_len, max_tokens)})
    return spec.model_copy(update={"calibration": cal})


def method_rotations(model: nn.Module, method: Method, rotations_dir: Path | None,
                     calib_tokens: Callable[[], torch.Tensor], bos: int | None, save_dir: Path | None,
                     progress: bool = False, max_tokens: int | None = None) -> tuple[Rotations, str]:
    """(rotations, where they came from) for a spec method."""
    if rotations_dir is not None:
        path = rotations_dir / f"{method.name}.safetensors"
        if path.is_file():
            rot = Rotations.load(path, model)
            _check_artifact_spec(path, method, rot)
            return rot, f"loaded {path}"
    num_layers = ModelFingerprint.of(model).num_layers
    spec = capped_spec(method.spec, max_tokens)
    batches = None
    if _needs_data(spec, num_layers):
        tokens = calib_tokens()[: spec.calibration.num_tokens]
        batches = make_batches(tokens, spec.calibration, bos)
    rot = calibrate(model, spec, batches, progress=progress)
    if batches is None:
        return rot, "fixed (no data)"
    source = f"calibrated on {rot.num_tokens} tokens"
    if save_dir is not None:
        save_dir.mkdir(parents=True, exist_ok=True)
        rot.save(save_dir / f"{method.name}.safetensors")
        source += f", saved to {save_dir / (method.name + '.safetensors')}"
    logger.info("%s: %s", method.name, source)
    return rot, source


def method_quantizers(model: nn.Module, method: Method, rotations_dir: Path | None,
                      calib_tokens: Callable[[], torch.Tensor], bos: int | None, save_dir: Path | None,
                      progress: bool = False, max_tokens: int | None = None
                      ) -> tuple[list[LayerQuantizer | None], str]:
    """(one quantizer or None per layer, a note on the rotations) for any method."""
    fp = ModelFingerprint.of(model)
    device = next(model.parameters()).device
    if method.kivi is not None:
        return [KiviQuantizer(method.kivi, fp.head_dim) for _ in range(fp.num_layers)], "none (KIVI)"
    spec = fit_spec(method.spec, fp.head_dim, fp.num_layers, fp.architecture)  # the eval's one fit per method
    layers = [spec.for_layer(i, fp.num_layers) for i in range(fp.num_layers)]
    if not any(layer.quantized for layer in layers):
        return [None] * fp.num_layers, "none (16-bit cache)"
    method = dataclasses.replace(method, spec=spec)  # calibrate takes it as fitted
    rot, source = method_rotations(model, method, rotations_dir, calib_tokens, bos, save_dir, progress, max_tokens)
    return spec_quantizers(layers, rot, fp.head_dim, device), source
