"""Deterministic mode: batch-invariant linear layers and fixed attention split plans.

Why: a request's logits must not depend on the requests that share its batch, nor change from
run to run (issue 31, item 4). Three things vary with the batch in the default mode:
- the GEMMs of the linear layers (QKV, O, MLP, LM head): the library picks its kernel and its
  split-K from the number of rows. Under this mode every ``F.linear`` (``nn.Linear`` and the merged
  projections of the rewritten graphs alike) runs ``batch_invariant_linear``: the persistent
  Triton matmul on CUDA (``matmul_triton``), fixed-shape row tiles on the CPU (``matmul_ref``);
- the attention split plans, sized from the batch and the SM count: under this mode the kernels
  split a sequence's history into parts of ``DETERMINISTIC_SPLIT_TOKENS`` from its first token
  (``split_tokens()`` is the dispatch-level input each kernel honours);
- the per-row reductions (RMSNorm, the softmax of the sampler) already reduce each row alone,
  in an order set by the row length: nothing to change (tests/kernels/test_batch_invariance.py).

``deterministic()`` turns the mode on for a block (the engine's runner wraps every forward and
every CUDA-graph capture in it when ``EngineConfig(deterministic=True)``); ``is_deterministic()``
is what kernels read. The switch is thread-local (the server's engine thread and a test's
thread do not see each other's mode).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# history tokens per attention split (a multiple of every kernel's history block: 64 and 128)
DETERMINISTIC_SPLIT_TOKENS = 2048
LINEAR_RANGE = "oscar::batch_invariant_linear"  # the profiler range of the Triton matmul (bench.serve)
_state = threading.local()


def is_deterministic() -> bool:
    """Whether the calling thread runs under ``deterministic()``."""
    return getattr(_state, "on", False)


def split_tokens() -> int | None:
    """History tokens per split the attention kernels must use (None: plan freely)."""
    return DETERMINISTIC_SPLIT_TOKENS if is_deterministic() else None


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose every output row depends on its input row only (see the module docstring)."""
    if x.is_cuda:
        from oscar_compile.kernels.matmul.matmul_triton import linear_triton

        if torch.autograd._profiler_enabled():  # a named range, so that profiles count it as a GEMM
            with torch.profiler.record_function(LINEAR_RANGE):
                return linear_triton(x, weight, bias)
        return linear_triton(x, weight, bias)
    from oscar_compile.kernels.matmul.matmul_ref import linear_tiled

    return linear_tiled(x, weight, bias)


class _BatchInvariantOps(TorchFunctionMode):
    """Routes ``F.linear`` to ``batch_invariant_linear`` while the mode is on (a nested
    ``deterministic(False)`` turns it off); every other call runs as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is F.linear or func is torch._C._nn.linear) and is_deterministic():
            return batch_invariant_linear(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def deterministic(enabled: bool = True):
    """Run the block in deterministic mode (``enabled=False``: in the default mode). Nests."""
    previous = is_deterministic()
    _state.on = enabled
    try:
        if enabled and not previous:
            with _BatchInvariantOps():
                yield
        else:
            yield
    finally:
        _state.on = previous
