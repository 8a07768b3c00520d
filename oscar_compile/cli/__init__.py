"""``oscar-compile``: every command of the project, one subcommand each.

calibrate / inspect (``calibrate.py``), demo (``demo.py``), eval (``eval.py``), sweep (``sweep.py``), serve
(``serve.py``), bench (``bench.py``) and export (``export.py``). Each module adds its parser; the work is imported only
when a command runs, so ``oscar-compile --help`` stays fast. User errors (a bad spec, a missing
file, an unsupported combination) exit with status 2 and one line on stderr.
"""
from __future__ import annotations

import argparse
import logging
import sys

from . import bench, calibrate, demo, eval, export, serve, sweep

logger = logging.getLogger("oscar_compile")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oscar-compile",
                                     description="KV-cache compression for Hugging Face LLMs: "
                                                 "every command, one subcommand each")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    calibrate.add_parsers(sub)
    demo.add_parser(sub)
    eval.add_parser(sub)
    sweep.add_parser(sub)
    serve.add_parser(sub)
    bench.add_parser(sub)
    export.add_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as err:
        print(f"oscar-compile {args.command}: error: {err}", file=sys.stderr)
        return 2
