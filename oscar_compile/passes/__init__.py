"""Graph passes that rewrite a Hugging Face model's attention (see apply.py)."""
from __future__ import annotations

import oscar_compile.kernels.ops  # noqa: F401  registers the oscar:: ops the passes insert

from .apply import apply, set_prefill_semantics
from .backend import backend
from .compressed_model import CompressedModel
from .report import ApplyReport, LayerReport

__all__ = ["apply", "backend", "set_prefill_semantics", "CompressedModel", "ApplyReport", "LayerReport"]
