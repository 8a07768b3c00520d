"""The one place that knows how Gluon's API differs between Triton releases.

Gluon (``triton.experimental.gluon``) is experimental and renames things between minor
releases. The Hopper decode kernel must run on the device's Triton 3.6 and compile on the
newest release the registry serves, so every version-dependent name is resolved here, once:

- ``GluonASTSource`` moved from ``gluon._runtime`` to the ``gluon`` package (offline compiles).
- The CTA barrier is ``gl.thread_barrier`` up to 3.6 and ``gl.barrier`` from 3.7
  (``thread_barrier`` here).
- cp.async is ``ampere.async_copy.async_copy_global_to_shared`` in 3.6, ``async_load`` later
  (``async_copy`` here; ``commit_group`` and ``wait_group`` keep their names).

Importing this module never raises: ``GLUON_IMPORT_ERROR`` says why Gluon is unusable (no
Triton, or a Triton without Gluon's Hopper ops), and the dispatch then keeps the Triton kernel.
"""
from __future__ import annotations

GLUON_IMPORT_ERROR: str | None = None

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp_async
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except Exception as exc:  # noqa: BLE001 - any failure means "no Gluon here"
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    gluon = gl = fence_async_shared = warpgroup_mma = warpgroup_mma_wait = _cp_async = None

thread_barrier = None if gl is None else getattr(gl, "barrier", None) or gl.thread_barrier
async_copy = None if _cp_async is None else (getattr(_cp_async, "async_load", None)
                                             or _cp_async.async_copy_global_to_shared)
commit_group = None if _cp_async is None else _cp_async.commit_group
wait_group = None if _cp_async is None else _cp_async.wait_group


def gluon_ast_source():
    """``GluonASTSource`` (for compiling a Gluon kernel offline, without a GPU)."""
    try:
        from triton.experimental.gluon import GluonASTSource
    except ImportError:
        from triton.experimental.gluon._runtime import GluonASTSource
    return GluonASTSource
