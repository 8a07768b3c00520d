"""Graph passes that rewrite a Hugging Face model's attention (see apply.py)."""
from __future__ import annotations

import oscar_compile.kernels.ops  # noqa: F401  registers the oscar:: ops the passes insert

from .apply import ApplyReport, LayerReport, apply
from .backend import backend

__all__ = ["apply", "backend", "ApplyReport", "LayerReport"]
