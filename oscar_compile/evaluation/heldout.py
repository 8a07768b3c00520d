"""Where the evaluation reads from: the model, the held-out and calibration token files.

Defaults are the bundled model (``oscar_compile/bundled/oscar-tiny-qwen3``) with its
``heldout.bin`` and ``calib.bin``. The two splits must never overlap: the same file (or two files
with identical bytes) for ``data`` and ``calib`` is refused, since rotations calibrated on the
evaluation text would flatter every calibrated method.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from ..calibration.tokens import load_tokens
from ..loading import BUNDLED_MODEL_DIR as BUNDLED_MODEL

logger = logging.getLogger(__name__)


def resolve_paths(model: str | Path | None, data: str | Path | None,
                  calib: str | Path | None) -> tuple[Path, Path, Path]:
    """(model dir, held-out file, calibration file), defaults filled from the model dir."""
    model_dir = Path(model) if model is not None else BUNDLED_MODEL
    if not model_dir.is_dir():
        hint = " (the bundled model is not in this checkout yet: pass --model)" if model is None else ""
        raise FileNotFoundError(f"no model directory at {model_dir}{hint}")
    paths = []
    for given, default, flag in ((data, "heldout.bin", "--data"), (calib, "calib.bin", "--calib")):
        path = Path(given) if given is not None else model_dir / default
        if not path.is_file():
            raise FileNotFoundError(f"no file at {path}" + ("" if given is not None else f": pass {flag}"))
        paths.append(path)
    check_disjoint(paths[0], paths[1])
    return model_dir, paths[0], paths[1]


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_disjoint(data: Path, calib: Path) -> None:
    """Refuse to evaluate on the calibration file (same path, or the same bytes under another name)."""
    same = data.resolve() == calib.resolve() or data.samefile(calib)
    if not same and data.stat().st_size == calib.stat().st_size:
        same = _digest(data) == _digest(calib)
    if same:
        raise ValueError(
            f"the evaluation data ({data}) and the calibration data ({calib}) are the same file: rotations "
            "calibrated on the evaluation text flatter every calibrated method. Give disjoint splits "
            "(e.g. the bundled heldout.bin and calib.bin)."
        )


def bos_id(model, tokenizer) -> int | None:
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    return bos if bos is not None else getattr(model.config, "bos_token_id", None)


def read_tokens(path: Path, tokenizer) -> torch.Tensor:
    """[N] int64 token ids of a ``.bin``/``.npy``/``.pt`` file, or of a text file (tokenized)."""
    return load_tokens(path, tokenizer)


def heldout_windows(tokens: torch.Tensor, length: int, num: int, bos: int | None) -> torch.Tensor:
    """[n, length] non-overlapping windows from the start of ``tokens``, BOS first when the model has one.

    Fewer than ``num`` when the file is short (logged); none at all is an error.
    """
    body = length - (bos is not None)
    available = len(tokens) // body
    if available == 0:
        raise ValueError(f"the held-out data has {len(tokens)} tokens, a window of context {length} needs {body}")
    if available < num:
        logger.warning("only %d held-out windows of %d tokens (asked for %d)", available, length, num)
    n = min(num, available)
    windows = tokens[: n * body].reshape(n, body)
    if bos is not None:
        windows = torch.cat([torch.full((n, 1), bos, dtype=torch.long), windows], dim=1)
    return windows
