"""``oscar-compile eval``: the side-by-side comparison, whose options and run live in the evaluation
(``oscar_compile.evaluation.command``, which ``python -m oscar_compile.evaluation`` runs too)."""
from __future__ import annotations

import argparse

from ..evaluation.command import EPILOG, HELP, configure_parser


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``eval`` on the ``oscar-compile`` subcommand parser."""
    p = subparsers.add_parser("eval", help=HELP, description=HELP, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    return configure_parser(p)
