"""Where a kernel runs, as launch plans read it besides tensor shapes (never device values: plans
stay CUDA-graph safe): the GPU's SM count, and whether Triton's interpreter runs the kernels."""
from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=8)
def _cuda_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 stands in for a CPU (the interpreter)."""
    return _cuda_sms(device.index or 0) if device.type == "cuda" else 4


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels then pick interpreter-friendly variants)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
