"""Counting Triton JIT compiles, and warning about the ones that happen while a server runs.

A compile takes seconds (H200: 2-6 s per attention variant) and holds the engine thread, so a
server that meets a new kernel specialization mid-serve stalls every running request for that
long (H200, 16 concurrent requests on the bundled model: one 24 s pause,
bench/results/2026-12-02-h200-serve-load). The runner compiles the variants it knows at startup
(``CompressedRunner._compile_prefill_kernels``, the CUDA graphs); this module makes the ones it
missed visible: after ``mark_serving()`` each compile is logged as a warning with the kernel's
specialization and its time, and counted for ``/metrics``.

Triton calls ``knobs.runtime.jit_cache_hook`` before it compiles a specialization it has not
run in this process (an on-disk cache hit included: then the compile is short) and
``jit_post_compile_hook`` after; both take keyword arguments (``repr``: the kernel and its
argument types). Hooks already set by someone else keep running, after ours.
"""
from __future__ import annotations

import logging
import threading
import time

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_started: dict[int, float] = {}  # thread -> when its compile began
_installed = False
_serving = False
_stats = {"jit_compiles_total": 0, "jit_compiles_while_serving": 0, "jit_compile_seconds_while_serving": 0.0}


def install() -> bool:
    """Put the hooks in place (once; False where this Triton has no compile hooks)."""
    global _installed
    try:
        from triton import knobs

        runtime = knobs.runtime
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        return False
    with _lock:
        if _installed:
            return True

        def cache_hook(*args, **kwargs):
            _started[threading.get_ident()] = time.perf_counter()
            return before(*args, **kwargs) if before else None  # (truthy: "skip this compile")

        def post_compile_hook(*args, **kwargs):
            start = _started.pop(threading.get_ident(), None)
            note_compile(_describe(kwargs), None if start is None else time.perf_counter() - start)
            return after(*args, **kwargs) if after else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = cache_hook, post_compile_hook
        _installed = True
    return True


def _describe(hook_kwargs: dict) -> str:
    """The kernel, its argument specialization and its constexpr values (what the warmup missed)."""
    what = str(hook_kwargs.get("repr", "a Triton kernel"))
    compile_info = hook_kwargs.get("compile") or {}
    constants = compile_info.get("constants") or {}
    params = getattr(getattr(hook_kwargs.get("fn"), "jit_function", None), "params", [])

    def name(key):  # Triton keys constexprs by argument index paths, (i,)
        if isinstance(key, tuple) and len(key) == 1 and isinstance(key[0], int) and key[0] < len(params):
            return params[key[0]].name
        return str(key)

    values = ", ".join(f"{name(k)}={v}" for k, v in constants.items() if isinstance(v, (bool, int, str)))
    # the arguments Triton specialized as divisible by 16 (pointers and ints): a compile that the
    # warmup seemed to cover differs from it here, if not in a constexpr
    configs = compile_info.get("configs") or [{}]
    aligned = [name(k) for k, v in (configs[0] or {}).items() if "divisibility" in str(v)]
    parts = [values] if values else []
    parts += [f"divisible by 16: {' '.join(aligned)}"] if aligned else []
    return f"{what} with {'; '.join(parts)}" if parts else what


def mark_serving(serving: bool = True) -> None:
    """From now on a compile is a stall of running requests: warn about each one."""
    global _serving
    _serving = serving


def note_compile(what: str, seconds: float | None) -> None:
    with _lock:
        _stats["jit_compiles_total"] += 1
        if not _serving:
            return
        _stats["jit_compiles_while_serving"] += 1
        _stats["jit_compile_seconds_while_serving"] += seconds or 0.0
    took = "" if seconds is None else f" in {seconds:.1f} s"
    _log.warning("Triton compiled %s%s while serving: the startup warmup does not cover this "
                 "specialization, and the running requests waited for it", what, took)


def compile_stats() -> dict[str, float]:
    """Compiles since ``install()`` (the server's: once its engine is built and warmed up), and
    those (and their seconds) after ``mark_serving()``."""
    with _lock:
        return dict(_stats)
