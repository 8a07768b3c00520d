"""Calibration data from a file: text (tokenized with the model's tokenizer) or token ids.

Token files: ``.bin`` (raw little-endian uint16 ids, the format the bundled model ships),
``.npy`` (any integer array) or ``.pt`` (an integer tensor). Everything else is read as UTF-8
text. The tokens are cut into ``seq_len`` windows, ``num_tokens`` in all, ``batch_size`` per batch.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..spec import CalibrationSpec

TOKEN_SUFFIXES = (".bin", ".npy", ".pt")


def read_token_file(path: Path) -> torch.Tensor:
    """[N] int64 token ids from a ``.bin`` / ``.npy`` / ``.pt`` file."""
    if path.suffix == ".bin":
        return torch.from_numpy(np.fromfile(path, dtype="<u2").astype(np.int64))
    if path.suffix == ".npy":
        return torch.from_numpy(np.load(path).astype(np.int64).reshape(-1))
    tokens = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point():
        raise ValueError(f"{path}: expected an integer tensor of token ids")
    return tokens.long().reshape(-1)


def load_tokens(path: str | Path, tokenizer=None, max_tokens: int | None = None) -> torch.Tensor:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no data file at {path}")
    if path.suffix in TOKEN_SUFFIXES:
        tokens = read_token_file(path)
    else:
        if tokenizer is None:
            raise ValueError(f"{path} is text: a tokenizer is needed (give --model a directory with one)")
        tokens = torch.tensor(tokenizer(path.read_text(encoding="utf-8"))["input_ids"], dtype=torch.long)
    return tokens if max_tokens is None else tokens[:max_tokens]


def make_batches(tokens: torch.Tensor, calibration: CalibrationSpec,
                 bos_token_id: int | None = None) -> list[torch.Tensor]:
    """Cut ``tokens`` into [batch_size, seq_len] batches (a BOS in front of each window when given)."""
    body = calibration.seq_len - (bos_token_id is not None)
    num_windows = min(len(tokens), calibration.num_tokens) // body
    if num_windows == 0:
        raise ValueError(
            f"not enough calibration tokens: {len(tokens)} available, one window needs {body} "
            f"(seq_len {calibration.seq_len})"
        )
    windows = tokens[: num_windows * body].reshape(num_windows, body)
    if bos_token_id is not None:
        windows = torch.cat([torch.full((num_windows, 1), bos_token_id, dtype=torch.long), windows], dim=1)
    return list(windows.split(calibration.batch_size))
