"""Which kernel runs ``oscar::attention`` on CUDA: the Gluon Hopper kernel, the extend path or the fused Triton one.

- ``auto`` (default): prefill-like calls over INT-b history take the extend path
  (``attention_extend_triton``: the history dequantized once per call, then the paged BF16
  kernel; its ``extend_unsupported_reason`` says which calls, on any CUDA GPU); Gluon on sm_90
  (H100 / H200) for every call it takes (decode-like INT2 and INT4 batches, see
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

**The setting is read once.** An :class:`AttentionDispatch` holds it, taken when the dispatch is
built: the runner builds its own (``CompressedRunner``, so at engine start), and the paths
without a runner that reach this op on CUDA (``generate()`` or a forward after ``apply()``, which
the eval's prefix-hit runs use, and the ``torch.compile`` backend) share
:func:`default_attention_dispatch`, built at the first such call. (The eval's simulation and the
ONNX export run no CUDA attention: nothing is chosen there.)
:func:`attention_kernel_from_env` is the one place that reads ``OSCAR_ATTENTION_KERNEL``
(``tests/test_import_rules.py`` fails on any other environment read under ``kernels/``).

The choice reads shapes, dtypes and the device only (never tensor values): CUDA-graph safe. Each
new (kernel, reason) is logged once, and ``kernels_in_use()`` reports what ran, for ``/metrics``.

**Planned once per step** (issue #32; FlashInfer's plan() / run()): every layer of a step calls
the op with the same shapes, so the dispatch keeps the choice and the kernel's launch plan
(query blocks, history splits, window programs) under a key of everything they read (``plan_key``:
the shapes, dtypes, device, geometry, deterministic mode and the device check) and the first layer
plans for the others. The runner opens ``dispatch.step()`` around each forward: the plans are the
step's, dropped when it ends. On an H200-like host (the dispatch and the wrappers with their
launches stubbed, bench/results/2026-12-03-cpu-plan-once) the plan was most of the Python an
INT2 decode layer ran before its launches, ``triton.cdiv`` on the host costing 2.7 µs a call. A
plan is a function of the key, so a memoized one launches exactly what a fresh one would
(bitwise the same outputs, and the same launches in a captured CUDA graph).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from typing import NamedTuple

import torch

from oscar_compile.formats.cache import code_layout
from oscar_compile.formats.op_args import AttentionArgs
from oscar_compile.kernels.determinism import split_tokens
from oscar_compile.kernels.device import interpreting

ENV = "OSCAR_ATTENTION_KERNEL"
CHOICES = ("auto", "gluon", "triton")
MAX_PLANS = 64  # keys a dispatch keeps outside a step: a few batch sizes x table widths x layer kinds
_log = logging.getLogger(__name__)


def check_kernel_setting(value: str) -> str:
    """A kernel setting (``auto``, ``gluon`` or ``triton``), normalized; anything else raises."""
    value = value.strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


def attention_kernel_from_env() -> str:
    """The ``OSCAR_ATTENTION_KERNEL`` setting, checked: the one read of it (when a dispatch is built)."""
    return check_kernel_setting(os.environ.get(ENV, "auto"))


@functools.lru_cache(maxsize=8)
def gluon_device_problem(device_index: int) -> str | None:
    """Why this CUDA device cannot run the Gluon kernel (None: it can)."""
    from oscar_compile.kernels.gluon_compat import GLUON_IMPORT_ERROR

    if GLUON_IMPORT_ERROR is not None:
        return f"Triton has no usable Gluon ({GLUON_IMPORT_ERROR})"
    if interpreting():
        return "the Triton interpreter runs no Gluon kernel"
    major, minor = torch.cuda.get_device_capability(device_index)
    if (major, minor) != (9, 0):
        return f"compute capability {major}.{minor} (the Gluon kernel is for sm_90)"
    return None


def choose_attention_kernel(q: torch.Tensor, k: torch.Tensor, k_win: torch.Tensor,
                            k_codes: torch.Tensor, k_scale: torch.Tensor, bits: int,
                            group_size: int, num_seqs: int, window_table: torch.Tensor | None = None,
                            quant_table: torch.Tensor | None = None, forced: str = "auto") -> tuple[str, str]:
    """("gluon_int8" | "gluon" | "extend" | "triton", why) for one CUDA call of ``oscar::attention``
    under the setting ``forced`` (without the tables, the extend path is not considered)."""
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
        from oscar_compile.kernels.attention.prefill.attention_extend_triton import extend_unsupported_reason

        why_not = extend_unsupported_reason(q, k, window_table, quant_table, k_win, bits, num_seqs, group_size)
        if why_not is None:
            return "extend", "prefill-like call over INT-b history"
    if problem is not None:
        return "triton", problem
    if code_layout(bits, q.shape[-1], k_win.shape[2]) == "masked":
        from oscar_compile.kernels.attention.decode.attention_gluon_int8 import int8_unsupported_reason

        why_not = int8_unsupported_reason(q, k, k_win, k_codes, k_scale, bits, group_size, q.shape[0], num_seqs)
        if why_not is None:
            return "gluon_int8", "sm_90, INT2 codes masked in place"
    from oscar_compile.kernels.attention.decode.attention_gluon import gluon_unsupported_reason

    why = gluon_unsupported_reason(q, k, k_win, k_codes, k_scale, bits, group_size, q.shape[0], num_seqs)
    if why is not None:
        return "triton", why
    return "gluon", "sm_90"


class AttentionPlan(NamedTuple):
    """What a dispatch runs for one call: the kernel, why, and the launch arguments its wrapper
    would have planned itself (``nsplit``, ``win_splits``...; empty: the wrapper plans)."""

    kernel: str
    why: str
    launch: dict  # (read only: shared by every call of the key)


def plan_key(a: AttentionArgs) -> tuple:
    """Everything ``choose_attention_kernel`` and the launch plans read besides the dispatch's
    setting: shapes, dtypes, the device, the geometry and the mode of the moment (tensor values never)."""
    wt, qt = a.window_table, a.quant_table
    return (split_tokens(), gluon_device_problem(a.q.device.index or 0), a.q.device, a.q.shape,
            a.q.dtype, a.k.shape, a.k_win.shape, a.k_win.dtype, a.k_codes.shape, a.k_scale.dtype,
            a.cache_lens.shape[0], None if wt is None else wt.shape, None if qt is None else qt.shape,
            a.bits, a.group_size, a.sink, a.recent)


def launch_plan(kernel: str, a: AttentionArgs) -> dict:
    """The launch arguments the wrapper of ``kernel`` plans from shapes (empty: it plans at each
    call, as the extend path does, and the others for an empty batch or the reference's shapes)."""
    N, H_q, D = a.q.shape
    if N == 0 or kernel == "extend":
        return {}
    H_kv, B, max_hist = a.k.shape[1], a.cache_lens.shape[0], a.quant_table.shape[1] * a.k_win.shape[2]
    if kernel == "triton":
        from oscar_compile.kernels.attention.decode.attention_triton import (
            history_block_n,
            kernel_takes,
            plan_triton_launch,
        )

        if not kernel_takes(H_q, H_kv, D, a.bits, a.group_size):
            return {}
        return {"launch_plan": plan_triton_launch(N, B, H_kv, H_q // H_kv, max_hist, a.q.device,
                                                  history_block_n(a.bits), a.sink + a.recent)}
    if kernel == "gluon_int8":
        from oscar_compile.kernels.attention.decode.attention_gluon_int8 import early_load_for, plan_int8_launch

        nsplit, nwin = plan_int8_launch(N, H_kv, H_q // H_kv, max_hist, a.sink, a.recent, a.q.device)
        return {"nsplit": nsplit, "win_splits": nwin, "early_load": early_load_for(max_hist, nsplit)}
    from oscar_compile.kernels.attention.decode.attention_gluon import MAXNREG, plan_gluon_launch

    nsplit, nwin = plan_gluon_launch(N, B, H_kv, H_q // H_kv, max_hist, a.sink, a.recent, a.q.device, MAXNREG, D)
    return {"nsplit": nsplit, "win_splits": nwin}


def run_planned(plan: AttentionPlan, a: AttentionArgs):
    """Launch the plan's kernel on the call's arguments."""
    kernel, _, launch = plan
    if kernel == "gluon_int8":
        from oscar_compile.kernels.attention.decode.attention_gluon_int8 import attention_gluon_int8

        return attention_gluon_int8(**a._asdict(), **launch)
    if kernel == "gluon":
        from oscar_compile.kernels.attention.decode.attention_gluon import attention_gluon

        return attention_gluon(**a._asdict(), **launch)
    if kernel == "extend":
        from oscar_compile.kernels.attention.prefill.attention_extend_triton import attention_extend_triton

        return attention_extend_triton(**a._asdict())
    from oscar_compile.kernels.attention.decode.attention_triton import attention_triton

    return attention_triton(**a._asdict(), **launch)


class KernelUsage:
    """Which kernels ran and why (the last reason of each), for ``/metrics``; each new
    (kernel, reason) pair logged once (a server alternating prefill chunks and 16-bit layers
    logged two lines per step)."""

    def __init__(self):
        self._used: dict[str, str] = {}
        self._logged: set[tuple[str, str]] = set()

    def note(self, kernel: str, why: str) -> None:
        self._used[kernel] = why
        if (kernel, why) not in self._logged:
            self._logged.add((kernel, why))
            _log.info("oscar::attention: %s kernel (%s)", kernel, why)

    def clear(self) -> None:
        """Forget what ran (a benchmark that switches kernels reports each setting's own)."""
        self._used.clear()

    def snapshot(self) -> dict[str, str]:
        return dict(self._used)


PROCESS_USAGE = KernelUsage()  # what ran in this process: /metrics reports it
_active = threading.local()  # .dispatch: the dispatch of the thread's step in progress


class AttentionDispatch:
    """The kernel choice of one owner (a runner; the paths without one share
    :func:`default_attention_dispatch`): its setting, read once when it is built, the plans it
    memoizes, and the record it notes each choice in (the process's by default).

    ``step()`` makes it the dispatch of the calling thread's ``oscar::attention`` calls for one
    step and drops the step's plans at the end. Outside a step the plans stay, up to
    ``max_plans`` (the oldest go first; 0 keeps none: every call plans, ``bench.serve --plan-ab``'s
    baseline)."""

    def __init__(self, kernel: str | None = None, usage: KernelUsage | None = None, max_plans: int = MAX_PLANS):
        self.kernel = attention_kernel_from_env() if kernel is None else check_kernel_setting(kernel)
        self.usage = PROCESS_USAGE if usage is None else usage
        self.max_plans = max_plans
        self.plans: dict[tuple, AttentionPlan] = {}  # plan_key -> plan, oldest first

    def choose(self, a: AttentionArgs) -> tuple[str, str]:
        return choose_attention_kernel(a.q, a.k, a.k_win, a.k_codes, a.k_scale, a.bits, a.group_size,
                                       a.cache_lens.shape[0], a.window_table, a.quant_table, forced=self.kernel)

    def plan(self, a: AttentionArgs) -> AttentionPlan:
        """The plan of this call: the memoized one of its ``plan_key`` (every layer of a step after
        the first), else a fresh one, kept."""
        key = plan_key(a)
        plan = self.plans.get(key)
        if plan is None:
            kernel, why = self.choose(a)
            plan = AttentionPlan(kernel, why, launch_plan(kernel, a))
            if self.max_plans > 0:
                if len(self.plans) >= self.max_plans:
                    del self.plans[next(iter(self.plans))]
                self.plans[key] = plan
        return plan

    def run(self, a: AttentionArgs):
        """``oscar::attention`` on CUDA, its arguments bound by name."""
        plan = self.plan(a)
        self.usage.note(plan.kernel, plan.why)
        return run_planned(plan, a)

    @contextlib.contextmanager
    def step(self):
        """One step: this dispatch serves the thread's ``oscar::attention`` calls, planning at the
        first layer for the others; the plans end with the step. Nests (the outer one resumes)."""
        previous = getattr(_active, "dispatch", None)
        _active.dispatch = self
        self.plans.clear()
        try:
            yield self
        finally:
            self.plans.clear()
            _active.dispatch = previous


@functools.cache
def default_attention_dispatch() -> AttentionDispatch:
    """The dispatch of the paths without a runner (``generate()`` or a forward after ``apply()``,
    the ``torch.compile`` backend): built at the first call of one of them, so the setting is read
    once per process. A runner builds its own."""
    return AttentionDispatch()


def active_attention_dispatch() -> AttentionDispatch:
    """The dispatch of the calling thread's step in progress, else the default one."""
    dispatch = getattr(_active, "dispatch", None)
    return default_attention_dispatch() if dispatch is None else dispatch


def attention_cuda(a: AttentionArgs):
    """``oscar::attention`` on CUDA (ops.py): the active dispatch runs it."""
    return active_attention_dispatch().run(a)


def kernels_in_use() -> dict[str, str]:
    """The attention kernels that ran in this process, with the reason each was chosen."""
    return PROCESS_USAGE.snapshot()
