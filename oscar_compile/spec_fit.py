"""Fit a compression spec to one model: the check every entry point runs before any work.

A spec is written once and used on many models (``specs/*.yaml`` ship for every supported
family), but whether it fits depends on the model: a quantization group must divide the head
dim, an override must name a layer the model has. Checking this in each command let
``oscar-compile calibrate`` accept a spec that the server then refused, so the check lives
here, once, with one message, and ``calibrate``, ``apply``, ``compress`` / ``LLM``, the CLI and
the server all call it (the library verbs too, so a user calling them directly gets the same).

Fitting also resolves the one model-dependent default: a ``group_size`` larger than the head
dim becomes the head dim (one group per head row), so ``group_size: 128`` works on head dims of
64, 80 and 96 as well as 128 and 256. The fitted spec is the one a rotation artifact records.
Torch-free: it reads two integers of the model.

The result is a :class:`FittedSpec`, made only by :func:`fit_spec`: the public doors (``apply``,
``calibrate``, ``compress``, ``save_compressed``, ``export_onnx``, the CLI, the eval, the
tensor-parallel launch, ``oscar_compile.assembly``) fit what they are given once, and everything
past them takes the fitted spec as it is. Fitting a ``FittedSpec`` again to the model it was
fitted to returns it unchanged, so a door called with one does no work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import PrivateAttr

from .spec import CompressionSpec, SpecError


class SpecDoesNotFitModel(SpecError):
    """The spec is valid on its own but cannot be applied to this model; lists every reason."""


@dataclass(frozen=True)
class FittedTo:
    """The model facts a spec was fitted to (what :func:`fit_spec` read)."""

    head_dim: int
    num_layers: int
    model: str | None = None

    def describe(self) -> str:
        return f"{self.model or 'the model'} (head_dim {self.head_dim}, {self.num_layers} layers)"


class FittedSpec(CompressionSpec):
    """A :class:`CompressionSpec` checked against one model and resolved for it (group sizes capped).

    Only :func:`fit_spec` makes one. It is a ``CompressionSpec`` in every other way: it
    serializes to the same JSON (the facts it was fitted to are not part of the spec) and
    compares equal to a plain spec with the same fields.
    """

    _fitted_to: FittedTo | None = PrivateAttr(default=None)

    @property
    def fitted_to(self) -> FittedTo:
        if self._fitted_to is None:
            raise TypeError("a FittedSpec is made by oscar_compile.spec_fit.fit_spec, not constructed directly")
        return self._fitted_to

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, CompressionSpec):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = CompressionSpec.__hash__

    def model_copy(self, *, update: dict | None = None, deep: bool = False) -> CompressionSpec:
        """A copy that changes the cache settings is a new spec, to be fitted again: a plain one."""
        if update and {"kv_cache", "layers"} & set(update):
            return CompressionSpec.model_validate({**dict(self), **update})
        return super().model_copy(update=update, deep=deep)


def _cap_group(kv, head_dim: int):
    if kv is None or kv.group_size is None or kv.group_size <= head_dim:
        return kv
    return kv.model_copy(update={"group_size": head_dim})


def fit_spec(spec: CompressionSpec, head_dim: int, num_layers: int, model: str | None = None) -> FittedSpec:
    """``spec`` resolved for a model of ``num_layers`` layers with ``head_dim`` channels per head.

    Raises :class:`SpecDoesNotFitModel` (a ``ValueError``) naming the model and every layer that
    cannot be stored as asked; returns the spec with group sizes capped at the head dim. A
    :class:`FittedSpec` fitted to the same head dim and layer count is returned as it is.
    """
    facts = FittedTo(head_dim, num_layers, model)
    if isinstance(spec, FittedSpec):
        done = spec.fitted_to
        if (done.head_dim, done.num_layers) != (head_dim, num_layers):
            raise SpecDoesNotFitModel(f"the compression spec was fitted to {done.describe()}, not to "
                                      f"{facts.describe()}: fit the spec as written to each model")
        return spec
    return _fit(spec, facts)


def _fit(spec: CompressionSpec, facts: FittedTo) -> FittedSpec:
    """The fit itself (tests count its calls: one per ``serve`` start)."""
    head_dim, num_layers = facts.head_dim, facts.num_layers
    what = facts.describe()
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
    out = FittedSpec.model_validate(dict(fitted))
    out._fitted_to = facts
    return out


def fit_spec_to_model(spec: CompressionSpec, model) -> FittedSpec:
    """:func:`fit_spec` for a loaded model or a Hugging Face config (what the entry points hold)."""
    from .architectures import ModelFingerprint

    fp = ModelFingerprint.of(model)
    return fit_spec(spec, fp.head_dim, fp.num_layers, fp.architecture)


def fit_spec_to_model_dir(spec: CompressionSpec, model_dir) -> FittedSpec:
    """:func:`fit_spec` from a model directory's ``config.json``: the commands check before loading weights."""
    from transformers import AutoConfig

    return fit_spec_to_model(spec, AutoConfig.from_pretrained(model_dir))


__all__ = ["FittedSpec", "FittedTo", "SpecDoesNotFitModel", "fit_spec", "fit_spec_to_model", "fit_spec_to_model_dir"]
