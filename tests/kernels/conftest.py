"""Where the Triton kernels run in tests: CUDA when present, else the CPU interpreter.

CI sets ``TRITON_INTERPRET=1`` (before Triton is imported) and has no GPU; a CPU machine without
the variable skips the Triton tests rather than failing to compile them.
"""
from __future__ import annotations

import os

import pytest
import torch


def triton_device() -> str | None:
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    return None


@pytest.fixture
def tdevice() -> str:
    """Device for Triton kernel tests; skips when Triton can run nowhere here."""
    pytest.importorskip("triton")
    dev = triton_device()
    if dev is None:
        if os.environ.get("CI"):  # a CI run that skipped every kernel test would pass untested
            pytest.fail("CI: no CUDA device and TRITON_INTERPRET is not set, so no kernel would run")
        pytest.skip("no CUDA device and TRITON_INTERPRET is not set")
    return dev
