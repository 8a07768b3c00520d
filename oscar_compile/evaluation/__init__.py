"""Side-by-side evaluation of KV-cache compression methods (docs/design.md §7): ``oscar-compile eval``.

``evaluate(model=..., specs=[...], contexts=[...], out=...)`` runs BF16, naive INT2, a KIVI-style
baseline, Hadamard and OSCAR variants on the same held-out data with the compressed cache
*simulated* (simulate.py: fake-quantize each sequence once, attend through masks), which the
tests prove equal to ``apply()`` + the real cache. Importing this package is cheap.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "evaluate": ".runner",
    "EvalConfig": ".config",
    "DEFAULT_METHODS": ".methods",
    "resolve_method": ".methods",
    "KiviConfig": ".kivi",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
