"""A measurement's result file: the one way the measurement commands (``python -m
oscar_compile.bench.*``, ``python -m oscar_compile.evaluation.prefix_hits``) write their JSON, so
that their ``--out`` files read alike.

It sits in ``evaluation``, not ``bench``, because ``bench`` imports ``evaluation`` (the held-out
data) and never the reverse. It imports nothing heavy: a bench that only times kernels pays
nothing for it.
"""
from __future__ import annotations

import json


def save_json(result, path: str | None) -> None:
    """Write ``result`` (a dict or a list of rows) as JSON, indent 1, to ``path``; nothing when
    ``path`` is empty (no ``--out``). A command that measures in parts calls it after each part,
    so a run stopped by a time limit still leaves what it measured."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
