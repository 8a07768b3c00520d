"""The one property of the GPU that launch plans read besides tensor shapes (never device values:
plans stay CUDA-graph safe)."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def _cuda_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 stands in for a CPU (the interpreter)."""
    return _cuda_sms(device.index or 0) if device.type == "cuda" else 4
