"""A step's op inputs on the device, rebuilt from the engine's Python lists without re-sending whole page tables.

A 128k-token sequence holds 8k quant pages of 16 tokens: turning every table of a 64-sequence
batch into a tensor each decode step would cost more host time than the step itself. A
:class:`TableMirror` keeps, per batch row, the list it last uploaded (the engine's own list
object: the block manager only appends to it while the sequence runs and replaces it when the
sequence is (re)allocated; the mirror holds a reference, so a new list can never pass for an
old one), writes only the new tail into a pinned host copy and sends the used rows to the
device in one copy. :class:`StepInputs` packs the flattened tokens and per-sequence integers
the same way. Buffers have fixed capacities and tensors handed out are views of the same
storage every step: what a captured CUDA graph reads.

Host copies are rewritten on the next step, so ``load`` first waits for the event recorded
after the previous step's copies: a step that samples nothing (a prefill chunk that finishes no
prompt) does not sync with the host, and the GPU may still be behind. Waiting there lets the CPU
prepare step N + 1 while step N runs, no further.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from oscar_compile.runtime.worker.runner import Batch


def _pinned(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")


class TableMirror:
    """Device copy of up to ``max_rows`` page-id lists of at most ``width`` entries each.

    Rows past the given tables (padding rows) hold ``fill`` everywhere.
    """

    def __init__(self, max_rows: int, width: int, device: torch.device, fill: int = 0):
        self.max_rows, self.width, self.fill = max_rows, max(1, width), fill
        self.host = _pinned((max_rows, self.width), torch.int32, device).fill_(fill)
        self._host_np = self.host.numpy()
        self.device_table = self.host.to(device)
        self._uploaded: list[tuple[Seq[int] | None, int]] = [(None, 0)] * max_rows

    def update(self, tables: list[Seq[int]], rows: int, trim: bool) -> torch.Tensor:
        """The device table of ``tables`` padded to ``rows`` rows: ``[rows, width]``, or with
        ``trim`` only as many columns as the longest table needs (at least one)."""
        if rows > self.max_rows or rows < len(tables):
            raise ValueError(f"{len(tables)} tables padded to {rows} rows; the mirror holds {self.max_rows}")
        used = 1
        for i, table in enumerate(tables):
            n = len(table)
            if n > self.width:
                raise ValueError(f"a page table of {n} entries; the mirror holds {self.width}")
            obj, done = self._uploaded[i]
            start = done if obj is table and n >= done else 0
            if start < n:
                self._host_np[i, start:n] = table[start:]
            self._uploaded[i] = (table, n)
            used = max(used, n)
        for i in range(len(tables), rows):
            if self._uploaded[i][0] is not None:  # a real table sat here: back to padding
                self._host_np[i] = self.fill
                self._uploaded[i] = (None, 0)
        self.device_table[:rows].copy_(self.host[:rows], non_blocking=True)
        return self.device_table[:rows, :used] if trim else self.device_table[:rows]


class StepInputs:
    """Device tensors of one packed step: token ids, positions, cu_seqlens, lengths, page tables.

    ``load(batch, pad_to)`` fills them and returns views. Rows ``[B, pad_to)`` are padding
    sequences of one token at position 0 whose page tables hold only the ``scratch`` ids (the
    runner keeps one scratch page per pool), so they touch no page a sequence owns.
    ``graph_shapes=True`` hands out full-width tables (fixed shapes for CUDA graphs); otherwise
    tables are trimmed to the batch's longest, so kernels plan their splits for the real length.
    """

    def __init__(self, max_seqs: int, max_tokens: int, window_width: int, quant_width: int,
                 device: torch.device, scratch_window: int = 0, scratch_quant: int = 0):
        self.max_seqs, self.max_tokens = max_seqs, max_tokens
        self._tokens_host = _pinned((2, max_tokens), torch.int64, device)  # ids, positions
        self._tokens = self._tokens_host.to(device)
        self._ints_host = _pinned((3, max_seqs + 1), torch.int32, device)  # cu, cache_lens, history_lens
        self._ints = self._ints_host.to(device)
        self._pending_host = _pinned((2, max_seqs), torch.int64, device)  # token index, source row
        self._pending = self._pending_host.to(device)
        self.windows = TableMirror(max_seqs, window_width, device, fill=scratch_window)
        self.quants = TableMirror(max_seqs, quant_width, device, fill=scratch_quant)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None  # the last step's copies

    def fits(self, batch: Batch, pad_to: int | None = None) -> bool:
        S = batch.num_seqs if pad_to is None else pad_to
        return S <= self.max_seqs and batch.num_tokens + S - batch.num_seqs <= self.max_tokens

    def load(self, batch: Batch, pad_to: int | None = None, graph_shapes: bool = False,
             pending_tokens: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The step's input views; ``pending_tokens`` (the previous step's sampled ids, on the
        device) fill the placeholder tokens of ``batch.pending_rows`` by a device-side copy."""
        B = batch.num_seqs
        S = B if pad_to is None else pad_to
        if S < B or not self.fits(batch, S):
            raise ValueError(f"a step of {B} sequences / {batch.num_tokens} tokens padded to {S} sequences does "
                             f"not fit {self.max_seqs} sequences / {self.max_tokens} tokens")
        if self._copied is not None:
            self._copied.synchronize()  # the host buffers below are free again
        n_real = batch.num_tokens
        N = n_real + S - B  # padding sequences bring one token each
        tok = self._tokens_host.numpy()
        tok[0, :n_real] = [t for ids in batch.token_ids for t in ids]
        tok[1, :n_real] = [p for pos in batch.positions for p in pos]
        tok[:, n_real:N] = 0
        ints = self._ints_host.numpy()
        ints[0, 0] = 0
        ints[0, 1:B + 1] = [len(ids) for ids in batch.token_ids]
        ints[0, B + 1:S + 1] = 1
        ints[0, :S + 1] = ints[0, :S + 1].cumsum()
        ints[1, :B], ints[2, :B] = batch.cache_lens, batch.history_lens
        ints[1:, B:S] = 0
        for row in (0, 1):  # contiguous slices only: a strided pinned copy would not stay asynchronous
            self._tokens[row, :N].copy_(self._tokens_host[row, :N], non_blocking=True)
        self._ints.copy_(self._ints_host, non_blocking=True)
        tables = dict(window_table=self.windows.update(batch.window_tables, S, trim=not graph_shapes),
                      quant_table=self.quants.update(batch.quant_tables, S, trim=not graph_shapes))
        if batch.pending_rows:
            if pending_tokens is None:
                raise ValueError("the batch runs pending tokens: pass the previous step's sampled ids")
            n = len(batch.pending_rows)
            pend = self._pending_host.numpy()
            pend[0, :n] = ints[0, list(batch.pending_rows)]  # a pending row's one token sits at cu[row]
            pend[1, :n] = batch.pending_src
            for row in (0, 1):
                self._pending[row, :n].copy_(self._pending_host[row, :n], non_blocking=True)
            self._tokens[0].index_copy_(0, self._pending[0, :n], pending_tokens.index_select(0, self._pending[1, :n]))
        if self._copied is not None:
            self._copied.record()
        return dict(
            input_ids=self._tokens[0, :N].unsqueeze(0),
            position_ids=self._tokens[1, :N].unsqueeze(0),
            cu_seqlens=self._ints[0, :S + 1],
            cache_lens=self._ints[1, :S],
            history_lens=self._ints[2, :S],
            **tables,
        )
