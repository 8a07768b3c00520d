"""oscar_compile: declarative INT2 KV-cache compression for Hugging Face causal LMs.

Two verbs and an artifact: ``calibrate(model, spec, batches) -> Rotations`` and
``apply(model, spec, rotations)``. Importing this package is cheap: heavy modules load on first use.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._version import __version__

_LAZY = {
    "CompressionSpec": ".spec",
    "SpecError": ".spec",
    "Rotations": ".artifact",
    "ArtifactError": ".artifact",
    "calibrate": ".calibration",
    "apply": ".passes",
    "backend": ".passes",
    "compress": ".compress",
    "LLM": ".llm",
    "SamplingParams": ".runtime.core.sampling_params",
    "save_compressed": ".checkpoint",
    "load_compressed": ".checkpoint",
    "deterministic": ".kernels.determinism",
}

if TYPE_CHECKING:  # pragma: no cover
    from .artifact import ArtifactError, Rotations
    from .calibration import calibrate
    from .checkpoint import load_compressed, save_compressed
    from .compress import compress
    from .kernels.determinism import deterministic
    from .llm import LLM
    from .passes import apply, backend
    from .runtime.core.sampling_params import SamplingParams
    from .spec import CompressionSpec, SpecError


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'oscar_compile' has no attribute {name!r}")


# A literal list (the sorted names of _LAZY, then __version__) so that linters see the imports above used.
__all__ = [
    "ArtifactError",
    "CompressionSpec",
    "LLM",
    "Rotations",
    "SamplingParams",
    "SpecError",
    "apply",
    "backend",
    "calibrate",
    "compress",
    "deterministic",
    "load_compressed",
    "save_compressed",
    "__version__",
]
