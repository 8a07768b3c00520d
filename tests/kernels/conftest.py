"""Where the Triton kernels run in tests: CUDA when present, else the CPU interpreter.

CI sets ``TRITON_INTERPRET=1`` (before Triton is imported) and has no GPU; a CPU machine without
the variable skips the Triton tests rather than failing to compile them.
"""
from __future__ import annotations

import os

import numpy as np
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


@pytest.fixture
def row_invariant_dot(monkeypatch):
    """Under the interpreter, a ``tl.dot`` whose every row is computed alone (on CUDA: nothing).

    Why: the interpreter's ``tl.dot`` is numpy's matmul, and OpenBLAS's sgemm rounds a row
    differently by its place in the tile with its Haswell kernels, which it also picks on AMD EPYC
    hosts (a row moved by one place changed in 34 of 64 rows of a 64 x 32 x 32 product). A test of
    batch or chunk invariance then tests the host's BLAS, not the kernel: it passed on one CI host
    and failed on another. A row alone depends on itself and the other operand only, as a row of
    an MMA tile does on the GPU, so the kernel's own reduction order is what such a test sees."""
    if triton_device() != "cpu":
        return
    from triton.runtime import interpreter

    whole = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        rows = [whole(self, interpreter.TensorHandle(a.data[..., i:i + 1, :], a.dtype), b,
                      interpreter.TensorHandle(d.data[..., i:i + 1, :], d.dtype), input_precision,
                      max_num_imprecise_acc) for i in range(a.data.shape[-2])]
        return interpreter.TensorHandle(np.concatenate([r.data for r in rows], axis=-2), rows[0].dtype)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
