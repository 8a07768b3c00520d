"""A local Ray cluster for the replica tests: 2 CPUs, no dashboard, replicas at ``num_cpus`` 0.5.

The tests that need the cluster skip without Ray (the ``[ray]`` extra); the others run anyway.
Bounded: a watchdog ends the session with every thread's traceback if these tests run past
``_WATCHDOG_S`` (a hung replica must fail CI, not hold it). The cluster, its applications and the
watchdog end with this folder's last test (``pytest_runtest_teardown``), never at the session's
end: left running, the watchdog killed the whole suite 420 s after the first Ray test. pytest's
``package`` scope would not do it, as this folder is not a package.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import socket
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]
sys.path.insert(0, str(HERE.parents[1]))  # tests/runtime: server_http

_WATCHDOG_S = 420
# the engine flags of every test: the bundled model on the CPU, small KV pools, snapshots every 256 tokens
ENGINE_FLAGS = ["--device", "cpu", "--max-num-seqs", "8", "--kv-memory", "0.25", "--snapshot-interval", "256",
                "--replica-cpus", "0.5"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What this folder started, closed when the run leaves the folder.
_OPEN = contextlib.ExitStack()


def pytest_runtest_teardown(item, nextitem):
    if nextitem is None or HERE not in nextitem.path.parents:
        _OPEN.close()


@pytest.fixture(scope="session")
def ray_cluster():
    """(Ray Serve's HTTP port) of a local cluster of 2 CPUs."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    faulthandler.dump_traceback_later(_WATCHDOG_S, exit=True)
    _OPEN.callback(faulthandler.cancel_dump_traceback_later)
    path = os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}})
    _OPEN.callback(ray.shutdown)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    _OPEN.callback(serve.shutdown)
    return port


def deploy(name: str, route_prefix: str, extra_flags: list[str] = (), router: str = "prefix"):
    """Run the application ``oscar-compile serve --replicas 2`` builds, under ``route_prefix``."""
    from ray import serve

    from oscar_compile.cli.serve import engine_config, parse_args, server_config
    from oscar_compile.cli.serve_replicas import build_application

    args = parse_args([*ENGINE_FLAGS, "--replicas", "2", *extra_flags])
    app = build_application(args, engine_config(args), server_config(args), router=router)
    serve.run(app, name=name, route_prefix=route_prefix)


AFFINITY_APP = "affinity"


@pytest.fixture(scope="session")
def affinity_app(ray_cluster):
    """(port, route prefix) of 2 replicas behind the prefix-affinity router, shared by the tests
    (one deployment fewer: each costs two model loads on the 2 cores)."""
    from ray import serve

    deploy(AFFINITY_APP, "/affinity")
    _OPEN.callback(serve.delete, AFFINITY_APP)
    return ray_cluster, "/affinity"
