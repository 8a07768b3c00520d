"""Load a Hugging Face model directory and pick its device: the one place every command does it.

The CLI, the demo, the evaluation, the offline ``LLM`` and the server all load through here, so
a model is read the same way everywhere: SDPA attention, eval mode, float32 on a CPU (bf16
matmuls are slow there) and bfloat16 on a GPU unless told otherwise, no network.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads when a model does: the CLI's parsers import this module
    import torch

logger = logging.getLogger(__name__)

BUNDLED_MODEL_DIR = Path(__file__).resolve().parent / "bundled" / "oscar-tiny-qwen3"


def resolve_model_dir(model: str | Path | None) -> Path:
    """The model directory to load; the bundled tiny model when none is given."""
    path = Path(model) if model is not None else BUNDLED_MODEL_DIR
    if not (path / "config.json").is_file():
        hint = "pass --model DIR" if model is None else "expected a Hugging Face model directory"
        what = "the bundled model" if model is None else "model"
        raise FileNotFoundError(f"{what} was not found at {path} (no config.json): {hint}")
    return path


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto``: the GPU when torch sees one, else the CPU; asking for CUDA without one is an error."""
    import torch

    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` / ``auto``: bfloat16 on a GPU (the BF16 reference), float32 on a CPU."""
    import torch

    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}: use auto, bfloat16, float16 or float32")
    return resolved


def load_model(model_dir: str | Path, device: str | torch.device = "auto", dtype: str | torch.dtype | None = None,
               tokenizer_required: bool = True):
    """(model, tokenizer) from a directory, offline. Without ``tokenizer_required`` a folder with
    no tokenizer gives ``None`` for it (calibration and perplexity read token ids)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    # use_kernels=False: transformers >= 5.25 kernelizes by default when Hugging Face's `kernels`
    # is installed, which fetches kernels from the Hub (there is no network) and swaps the forwards
    # of the layers the passes rewrite; without `kernels` that default raises instead.
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=resolve_dtype(dtype, device),
                                                 attn_implementation="sdpa", use_kernels=False)
    model.to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError):
        if tokenizer_required:
            raise
        logger.info("no tokenizer in %s", model_dir)
        tokenizer = None
    return model, tokenizer
