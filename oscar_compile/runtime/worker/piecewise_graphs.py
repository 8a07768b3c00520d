"""Piecewise CUDA graphs of prefill and mixed steps: everything but attention, per padded token count.

An eager step of an 8B model launches a few thousand kernels from Python: a step of 544 tokens
(32 decode rows beside a 512-token chunk) spent 80 ms on the host against a decode graph's 8 ms
(H100, ``bench/results/2026-12-05-gpu-int2-prefill-end-to-end``, call 7), and under load most
steps are mixed. As vLLM v1 does, a step of up to ``max_tokens`` tokens is padded to the next
captured size and replays graphs of the dense work (embedding, norms, projections, RoPE, MLPs,
the LM head), captured once per size. Attention runs eagerly between the pieces: it reads the
step's lengths and page tables, which the kernels plan their launches from.

Per layer, the piece before attention ends by copying q, k and v of every padded token into
static buffers. Between two pieces the runner's ``StepCache`` of the real step takes them (its
first ``num_tokens`` rows) and the layer's attention core runs (``cache/attention_core.py``: the
calls the layer's graph makes between its two cache nodes); the output goes into a static buffer
that the next piece reads. Padding tokens flow through the dense work only: no cache write, no
attention, no logits kept. The LM head takes a static row list of the bucket's ``max_rows``
entries (the step's last-token rows, then row 0).

Capture runs the forward of the bucket's size on a :class:`_CaptureCache`: a graph ends where a
layer asks the cache for its op inputs and the next begins where it hands the output back; in
between the graph's own calls get an empty chunk. Everything happens on the scratch pages.

A replayed step equals the eager step of the same padded token count bitwise (cuBLAS chooses a
GEMM's algorithm by its M, so an eager step of another count may differ in the last bits). Steps
with prompt logits, staged rows or more rows than the bucket's LM head takes, and every step in
deterministic mode, run eagerly.
"""
from __future__ import annotations

import bisect
import logging

import torch

from oscar_compile.runtime.worker.cuda_graphs import capture_largest_first
from oscar_compile.runtime.worker.runner import Batch
from oscar_compile.runtime.worker.step_cache import StepCache

_log = logging.getLogger(__name__)

_SIZES = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def piecewise_sizes(max_tokens: int, budget: int) -> list[int]:
    """The padded token counts captured: the fixed ladder up to ``min(max_tokens, budget)``, and
    that bound itself (a step of the whole token budget pads nothing)."""
    top = min(max_tokens, budget)
    if top < 2:
        return []
    return sorted({s for s in _SIZES if s < top} | {top})


class PiecewiseGraphs:
    """The piecewise graphs of a ``CompressedRunner`` (its model, cache, scratch pages and
    attention cores), for steps of up to ``max_tokens`` tokens and ``max_rows`` sequences."""

    def __init__(self, runner, max_tokens: int, max_rows: int):
        self.runner = runner
        self.cores = runner.attention_cores
        self.sizes = piecewise_sizes(max_tokens, runner.inputs.max_tokens)
        self.max_rows = max_rows
        top = self.sizes[-1] if self.sizes else 0
        device = runner.device
        self.tokens = torch.zeros(2, top, dtype=torch.int64, device=device)  # ids, positions
        self.rows = torch.zeros(max(1, max_rows), dtype=torch.int64, device=device)
        self.qkv: list[torch.Tensor] | None = None  # [top, H, D] each, made at the first warm-up
        self.out: torch.Tensor | None = None  # [1, top, H_q, D]
        self.layers: list[tuple[int, object]] = []  # (layer index, LayerFormat) in the order the forward calls them
        self.empty_inputs = runner.empty_step_inputs()  # the capture's: one sequence, no token
        self.pool = None
        self.graphs: dict[int, tuple[list, torch.Tensor]] = {}  # size -> (pieces, logits)

    def rows_of(self, size: int) -> int:
        return min(size, self.max_rows)

    def can_run(self, batch: Batch) -> bool:
        if not self.graphs or batch.logit_rows or batch.staging_tables:
            return False
        n = batch.num_tokens
        return 0 < n <= self.sizes[-1] and batch.num_seqs <= self.rows_of(self._size(n))

    def _size(self, num_tokens: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    @torch.no_grad()
    def capture_all(self) -> None:
        """Capture every size (cuda_graphs.capture_largest_first). Any failure leaves no graph:
        prefill and mixed steps then run eagerly."""
        if not self.sizes or any(i not in self.cores for i in range(self.runner.num_layers)):
            _log.info("piecewise CUDA graphs: %s", "no size to capture" if not self.sizes
                      else "a layer's graph has no attention core (cache/attention_core.py); mixed steps run eagerly")
            return
        self.graphs = capture_largest_first(self.sizes, self._capture, "piecewise graphs (step tokens",
                                            "prefill and mixed steps run eagerly")

    def _capture(self, size: int) -> tuple[list, torch.Tensor]:
        """Warm up (Triton compiles the dense ops' kernels) and capture the pieces of ``size`` tokens.

        The warm-ups' blocks are cached on the side stream, where neither the graphs' pool nor a
        later step can reuse them: they go back before the capture (as ``torch.cuda.graph`` does
        on entry). An 8192-token capture beside a 60 GiB budget ran out of memory with 1.39 GiB
        of them held (H100, bench/results/2026-12-05-gpu-int2-prefill-end-to-end, call 16). A failure inside
        the capture ends it, so the stream is usable again (``capture_largest_first``'s fallback)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward(size)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            pieces: list = []
            try:
                logits = self.forward(size, pieces=pieces)
            except BaseException:
                _end_open_capture(pieces)
                raise
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if len(pieces) != len(self.layers) + 1:
            raise RuntimeError(f"{len(pieces)} pieces captured for {len(self.layers)} layers")
        return pieces, logits

    def forward(self, size: int, pieces: list | None = None, step=None) -> torch.Tensor:
        """The model over the static tokens of ``size`` on a :class:`_CaptureCache`: with
        ``pieces``, captured into CUDA graphs appended there; with ``step`` (the real step's
        StepCache and token count, a test's stand-in for replay), each layer's attention run in
        place of the graph's."""
        inputs = dict(self.empty_inputs, input_ids=self.tokens[0, :size].unsqueeze(0),
                      position_ids=self.tokens[1, :size].unsqueeze(0))
        cache = _CaptureCache(self, inputs, size, pieces, step)
        if pieces is not None:
            cache.begin_piece()
        logits = self.runner.forward(inputs, self.rows[:self.rows_of(size)], cache=cache).float()
        if pieces is not None:
            cache.end_piece()
        return logits

    def load(self, batch: Batch, pending_tokens: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The step's inputs (the runner's, trimmed tables), its tokens copied into the static ones
        and its last-token rows into the LM head's list."""
        runner = self.runner
        inputs = runner.load_inputs(batch, pending_tokens)
        n, B = batch.num_tokens, batch.num_seqs
        self.tokens[0, :n].copy_(inputs["input_ids"][0])
        self.tokens[1, :n].copy_(inputs["position_ids"][0])
        rows = self.rows[:self.rows_of(self._size(n))]
        rows[:B].copy_(inputs["cu_seqlens"][1:B + 1])
        rows[:B] -= 1
        rows[B:].zero_()
        return inputs

    def run(self, batch: Batch, pending_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, vocab]`` (float32): a view of the graph's output, valid until the next step."""
        inputs = self.load(batch, pending_tokens)
        step = self.runner.step_cache(batch, inputs)
        self.runner.mark_forward()
        return self.replay(self._size(batch.num_tokens), step, batch.num_tokens)[:batch.num_seqs]

    def replay(self, size: int, step: StepCache, n: int) -> torch.Tensor:
        """The pieces of ``size`` with the attention of the step's ``n`` tokens between them."""
        pieces, logits = self.graphs[size]
        qkv = self.step_views(n)
        with self.runner.attention.step():
            for piece, (i, layer) in zip(pieces, self.layers, strict=False):
                piece.replay()
                self.attend(step, qkv, i, layer)
            pieces[-1].replay()
        return logits

    def step_views(self, n: int) -> list[torch.Tensor]:
        """The static q / k / v of the step's ``n`` tokens, ``[1, H, n, D]`` as the graph hands
        them to the cache (made once a step: every layer's pieces write the same buffers)."""
        return [x[:n].transpose(0, 1).unsqueeze(0) for x in self.qkv]

    def attend(self, step, qkv: list[torch.Tensor], layer_idx: int, layer) -> None:
        """Layer ``layer_idx``'s attention over the step's tokens (:meth:`step_views`), into the
        static output."""
        q, k, v = qkv
        out = step.run_attention(layer_idx, q, k, v, layer, self.cores[layer_idx])
        self.out[:, :q.shape[2]].copy_(out)


def _end_open_capture(pieces: list) -> None:
    """End the capture a failure left open on the current stream (its graph is dropped with the
    error): a stream left capturing fails every later launch and ``empty_cache``."""
    if pieces and torch.cuda.is_current_stream_capturing():
        try:
            pieces[-1].capture_end()
        except RuntimeError:  # an invalidated capture still ends, with an error of its own
            pass


class _CaptureCache(StepCache):
    """The cache of a capture (or warm-up) forward: it copies each layer's q / k / v into the
    static buffers, ends the piece, hands the graph's calls an empty chunk (of the one empty
    sequence of ``PiecewiseGraphs.empty_inputs``, on the scratch pages), and begins the next piece
    with the static output."""

    def __init__(self, graphs: PiecewiseGraphs, inputs: dict, size: int, pieces: list | None, step):
        super().__init__(graphs.runner, inputs)
        self.graphs, self.size, self.pieces, self.step = graphs, size, pieces, step
        self.record_layers = not graphs.layers

    def begin_piece(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.graphs.pool)
        self.pieces.append(graph)

    def end_piece(self) -> None:
        self.pieces[-1].capture_end()

    def oscar_layer_inputs(self, layer_idx: int, q, k, v, layer) -> tuple:
        g = self.graphs
        flat = [x[0].transpose(0, 1) for x in (q, k, v)]  # [1, H, N, D] -> [N, H, D]
        if g.qkv is None:
            top = g.tokens.shape[1]
            g.qkv = [torch.empty(top, *x.shape[1:], dtype=x.dtype, device=x.device) for x in flat]
        for buf, x in zip(g.qkv, flat, strict=True):
            buf[:self.size].copy_(x)
        if self.record_layers:
            g.layers.append((layer_idx, layer))
        if self.pieces is not None:
            self.end_piece()
        return super().oscar_layer_inputs(layer_idx, *(x[:, :, :0] for x in (q, k, v)), layer)

    def oscar_layer_outputs(self, layer_idx: int, out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        g = self.graphs
        empty = super().oscar_layer_outputs(layer_idx, out, q[:, :, :0])  # [1, 0, H_q, D]
        if g.out is None:
            g.out = torch.zeros(1, g.tokens.shape[1], *empty.shape[2:], dtype=empty.dtype, device=empty.device)
        if self.step is not None:  # a stand-in for replay: the real step's attention, here
            step, n = self.step
            g.attend(step, g.step_views(n), layer_idx, next(layer for i, layer in g.layers if i == layer_idx))
        if self.pieces is not None:
            self.begin_piece()
        return g.out[:, :self.size]
