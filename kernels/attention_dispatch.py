"""Which kernel runs ``oscar::attention`` on CUDA: the Gluon Hopper kernel, the extend path or the fused Triton one.

- ``OSCAR_ATTENTION_KERNEL=auto`` (default): prefill-like calls over INT-b history take the
  extend path (``attention_extend_triton``: the history dequantized once per call, then the
  paged BF16 kernel; its ``extend_unsupported_reason`` says which calls, on any CUDA GPU);
  Gluon on sm_90 (H100 / H200) for every call it takes (decode-like INT2 and INT4 batches, see
  ``attention_gluon.gluon_unsupported_reason``); the fused Triton kernel for the rest (the
  prefill calls the extend path refuses, 16-bit layers, other GPUs). INT2 decode on sm_90 over
  masked code pages (``formats.cache.code_layout``: head_dim 128) goes to the 8-bit integer
  kernel (``attention_gluon_int8``: fp16 scales, 16-token pages, any GQA group, ragged lengths,
  prefix hits, 1-2 tokens per sequence; ``int8_unsupported_reason``).
- ``gluon``: the same, but a device or Triton that cannot run Gluon at all is an error, not a
  silent fallback (a benchmark that asked for Gluon must not time Triton).
- ``triton``: the fused Triton kernel everywhere (no extend path either).

In deterministic mode (``kernels.determinism.split_tokens()`` set) the fused Triton kernel runs
every call: it splits the history by that fixed number of tokens (attention_split_plan), which the
extend path and the Gluon kernel do not honour yet.

The choice reads shapes, dtypes and the device only (never tensor values): CUDA-graph safe. Each
new (kernel, reason) is logged once, and ``kernels_in_use()`` reports what ran, for ``/metrics``.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from oscar_compile.formats.cache import code_layout
from oscar_compile.formats.op_args import AttentionArgs
from oscar_compile.kernels.determinism import split_tokens

ENV = "OSCAR_ATTENTION_KERNEL"
CHOICES = ("auto", "gluon", "triton")
_log = logging.getLogger(__name__)
_used: dict[str, str] = {}  # kernel -> the reason it was last chosen
_logged: set[tuple[str, str]] = set()  # (kernel, reason) pairs already logged


def forced_kernel() -> str:
    """The ``OSCAR_ATTENTION_KERNEL`` setting, checked."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


@functools.lru_cache(maxsize=8)
def gluon_device_problem(device_index: int) -> str | None:
    """Why this CUDA device cannot run the Gluon kernel (None: it can)."""
    from oscar_compile.kernels.gluon_compat import GLUON_IMPORT_ERROR

    if GLUON_IMPORT_ERROR is not None:
        return f"Triton has no usable Gluon ({GLUON_IMPORT_ERROR})"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "the Triton interpreter runs no Gluon kernel"
    major, minor = torch.cuda.get_device_capability(device_index)
    if (major, minor) != (9, 0):
        return f"compute capability {major}.{minor} (the Gluon kernel is for sm_90)"
    return None


def choose_attention_kernel(q: torch.Tensor, k: torch.Tensor, k_win: torch.Tensor,
                            k_codes: torch.Tensor, k_scale: torch.Tensor, bits: int,
                            group_size: int, num_seqs: int, window_table: torch.Tensor | None = None,
                            quant_table: torch.Tensor | None = None) -> tuple[str, str]:
    """("gluon_int8" | "gluon" | "extend" | "triton", why) for one CUDA call of ``oscar::attention`` (without the
    tables, the extend path is not considered)."""
    forced = forced_kernel()
    if forced == "triton":
        return "triton", f"{ENV}=triton"
    if split_tokens() is not None:
        # deterministic mode: the kernels that take split_tokens() (attention_split_plan); the
        # extend path splits a call by sequence and the Gluon kernel plans from the SM count
        if forced == "gluon":
            raise RuntimeError(f"{ENV}=gluon: the Gluon kernel has no deterministic mode yet")
        return "triton", "deterministic mode"
    problem = gluon_device_problem(q.device.index or 0)
    if problem is not None and forced == "gluon":
        raise RuntimeError(f"{ENV}=gluon, but {problem}")
    if window_table is not None and quant_table is not None:
        from oscar_compile.kernels.attention_extend_triton import extend_unsupported_reason

        why_not = extend_unsupported_reason(q, k, window_table, quant_table, k_win, bits, num_seqs, group_size)
        if why_not is None:
            return "extend", "prefill-like call over INT-b history"
    if problem is not None:
        return "triton", problem
    if code_layout(bits, q.shape[-1], k_win.shape[2]) == "masked":
        from oscar_compile.kernels.attention_gluon_int8 import int8_unsupported_reason

        why_not = int8_unsupported_reason(q, k, k_win, k_codes, k_scale, bits, group_size, q.shape[0], num_seqs)
        if why_not is None:
            return "gluon_int8", "sm_90, INT2 codes masked in place"
    from oscar_compile.kernels.attention_gluon import gluon_unsupported_reason

    why = gluon_unsupported_reason(q, k, k_win, k_codes, k_scale, bits, group_size, q.shape[0], num_seqs)
    if why is not None:
        return "triton", why
    return "gluon", "sm_90"


def attention_cuda(a: AttentionArgs):
    """``oscar::attention`` on CUDA, its arguments bound by name."""
    kernel, why = choose_attention_kernel(a.q, a.k, a.k_win, a.k_codes, a.k_scale, a.bits, a.group_size,
                                          a.cache_lens.shape[0], window_table=a.window_table,
                                          quant_table=a.quant_table)
    note_choice(kernel, why)
    if kernel == "gluon_int8":
        from oscar_compile.kernels.attention_gluon_int8 import attention_gluon_int8

        return attention_gluon_int8(**a._asdict())
    if kernel == "gluon":
        from oscar_compile.kernels.attention_gluon import attention_gluon

        return attention_gluon(**a._asdict())
    if kernel == "extend":
        from oscar_compile.kernels.attention_extend_triton import attention_extend_triton

        return attention_extend_triton(**a._asdict())
    from oscar_compile.kernels.attention_triton import attention_triton

    return attention_triton(**a._asdict())


def note_choice(kernel: str, why: str) -> None:
    """Record the choice for ``kernels_in_use``; log each (kernel, reason) pair once (a server
    alternating prefill chunks and 16-bit layers logged two lines per step)."""
    _used[kernel] = why
    if (kernel, why) not in _logged:
        _logged.add((kernel, why))
        _log.info("oscar::attention: %s kernel (%s)", kernel, why)


def clear_kernels_in_use() -> None:
    """Forget what ran (a benchmark that switches kernels reports each setting's own)."""
    _used.clear()


def kernels_in_use() -> dict[str, str]:
    """The attention kernels that ran in this process, with the reason each was chosen."""
    return dict(_used)
