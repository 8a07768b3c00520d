"""``oscar-compile bench NAME [ARGS...]``: the benchmarks of ``oscar_compile.bench``, by name.

Each benchmark keeps its own flags (``oscar-compile bench serve --help``) and its
``python -m oscar_compile.bench.NAME`` form; this only dispatches, so the commands stay in one CLI.
"""
from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "kernels": "kernel times against the references (Triton / Gluon, GPU)",
    "serve": "the paged runtime: prefill and decode throughput, batch by context",
    "serve_random": "the server over a randomly initialised model of a real shape",
    "load": "an HTTP load test of a running (or launched) server",
}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark: " + ", ".join(BENCHMARKS),
                       description="\n".join(f"{k:>13}: {v}" for k, v in BENCHMARKS.items()),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=sorted(BENCHMARKS))
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    p.set_defaults(func=_run)


def _run(args) -> int:
    module = importlib.import_module(f"oscar_compile.bench.{args.name}")
    return module.main(args.args) or 0
