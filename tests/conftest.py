"""Suite-wide markers: ``gpu`` tests are skipped on machines without CUDA; the Ray tests are
one xdist group; under ``TRITON_INTERPRET=1`` a cheaper lookup of the builtins Triton's
interpreter patches; an xdist worker runs torch on one thread (the workers share the cores); on a
GPU, engines built without a budget take a share of the free memory, not the library's planned 0.9."""
import inspect
import os
from pathlib import Path

import pytest
import torch


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    _share_the_gpu(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    if os.environ.get("TRITON_INTERPRET") == "1":
        _cache_interpreter_builtin_names()


def _share_the_gpu(workers: int) -> None:
    """The library's default engine plans for 0.9 of the device, which must be free at its start:
    one process's. Here engines built without a budget take the default before the plan instead,
    half the free memory (the tests of the plan give their share), and under xdist each worker's
    half of a 1/workers share: the first of 8 workers' engines took 40 GB, and the kernel tests of
    the others ran out of memory (bench/results/2026-12-05-gpu-int2-prefill-end-to-end, call 7)."""
    if torch.cuda.is_available():
        from oscar_compile.runtime import engine_config
        from oscar_compile.runtime.core import config

        config.GPU_MEMORY_UTILIZATION = None
        engine_config._GPU_KV_FRACTION /= max(1, workers)


def _cache_interpreter_builtin_names() -> None:
    """Triton's interpreter (3.9) re-scans ``triton.language`` with ``inspect.getmembers`` at every
    call of a ``@triton.jit`` helper from a kernel: about a third of an interpreted kernel's time
    in the cache-write tests. The builtins a module holds are fixed, so scan each module once and
    patch, as before, those names whose current value is still a builtin (inside a launch they
    already hold the interpreter's wrappers and are left alone, as the full scan leaves them)."""
    try:
        from triton.language import core
        from triton.runtime import interpreter
    except ImportError:
        return
    if not (hasattr(interpreter, "_patch_builtin") and hasattr(interpreter, "_patch_attr")):
        return  # another Triton: its own lookup
    names: dict[int, list[str]] = {}

    def patch_builtin(pkg, builder, scope):
        if id(pkg) not in names:
            names[id(pkg)] = [name for name, member in inspect.getmembers(pkg) if core.is_builtin(member)]
        for name in names[id(pkg)]:
            member = getattr(pkg, name, None)
            if core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin


RAY_TESTS = Path(__file__).resolve().parent / "runtime" / "server" / "ray_serve"


def pytest_collection_modifyitems(config, items):
    for item in items:  # under xdist (--dist loadgroup) one worker runs them: their conftest starts
        # one Ray cluster and ends it after the folder's last test
        if RAY_TESTS in item.path.resolve().parents:
            item.add_marker(pytest.mark.xdist_group("ray"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``):
    small models run faster so on the shared CI cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
