"""``compress(model, spec, rotations, config)``: a loaded model made ready for the paged runtime.

The assembly step of the package: fit the spec to the model (``spec_fit``), get rotations
(calibrated without data, or read from a file), rewrite the model (``passes.apply``) and
describe its cache (``runtime.worker.compressed_runner.compressed_layout``). It lives at the top, beside
``LLM``, because it reaches into calibration, artifacts, passes and the runtime, which must not
reach into each other; the offline ``LLM`` and the server both call it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from oscar_compile.artifact import Rotations
from oscar_compile.calibration import calibrate
from oscar_compile.passes import CompressedModel, apply
from oscar_compile.runtime.engine_config import EngineConfig
from oscar_compile.runtime.worker.compressed_runner import compressed_layout, runner_factory
from oscar_compile.spec import CompressionSpec
from oscar_compile.spec_fit import fit_spec_to_model


def compress(model: torch.nn.Module, spec, rotations, config: EngineConfig | None,
             values_folded: bool = False) -> tuple[CompressedModel, EngineConfig, Callable]:
    """Apply ``spec`` to ``model`` in place; (the handle ``apply`` returned, the engine config, and
    the runner factory that serves it: the handle is handed to the runner, and the prefill
    semantics of the model's ``generate()`` set to the engine's).

    ``values_folded``: the model is a compressed checkpoint whose weights hold R_V already
    (``oscar_compile.checkpoint``); ``rotations`` are then its own, checked on load."""
    if not isinstance(spec, CompressionSpec):
        spec = CompressionSpec.from_yaml(spec)
    spec = fit_spec_to_model(spec, model)  # before calibrating or loading rotations
    if rotations is None:
        try:
            rotations = calibrate(model, spec)  # only none / hadamard rotations need no data
        except ValueError:
            raise ValueError("this spec's rotations are calibrated from data: pass rotations= (a file made by "
                             "`oscar-compile calibrate`, or a Rotations)") from None
    elif not isinstance(rotations, Rotations):
        rotations = Rotations.load(rotations, model)
    compressed = apply(model, spec, rotations, values_folded=values_folded)
    layout = compressed_layout(model, spec)
    config = dataclasses.replace(config or EngineConfig(), layout=layout)
    compressed.set_prefill_semantics(config.prefill_semantics)  # generate() on the served model reads as the engine
    return compressed, config, runner_factory(compressed, layout, config)
