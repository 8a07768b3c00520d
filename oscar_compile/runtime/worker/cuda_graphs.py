"""CUDA graphs of decode steps: one captured forward per padded batch size, replayed on static inputs.

A decode step of a 36-layer model launches several hundred small kernels; launched one by one
from Python they take longer than the GPU needs to run them at small batch. A graph is captured
for batch sizes 1, 2, 4, 8 and multiples of 16 up to the maximum, all of them when the runner is
built (``capture_all``), as serving engines do: capturing, and compiling the kernel variants a
size needs (Triton specializes integer arguments equal to 1 and multiples of 16), then never
stalls a running batch. (With lazy capture, an H200 end-to-end run at batch 16 spent ~11 s of a
26 s decode phase in a few slow steps, which captures at its shrinking tail would explain.) A batch
of B sequences replays the graph of the next size up, its extra rows being padding sequences on
the scratch pages (see StepInputs). Shapes that the kernels plan their launches from (the number
of tokens and sequences, the page-table widths) are fixed per graph; values (lengths, tables,
tokens) are read from the static buffers at replay, and the kernels decide from them on the device.

Capture runs the forward on an all-padding batch, so warming up and capturing never write to a
page that a sequence owns (writing a real token twice would demote the wrong ring entry).
"""
from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import time

import torch

from oscar_compile.runtime.worker.runner import Batch

_log = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off (after one full pass) while graphs are captured.

    A collection inside a capture can free a dead engine's CUDA graphs, and destroying a graph
    while a stream captures invalidates that capture (``cudaErrorStreamCaptureInvalidated``):
    with a former engine's graphs dying mid-capture, a BF16 test engine decoded eagerly (H200,
    bench/results/2026-12-05-gpu-int2-prefill-end-to-end, call 17). ``torch.cuda.graph`` no longer
    collects on entry (``torch.compiler.config.force_cudagraph_gc``, off by default); SGLang's and
    vLLM's graph runners freeze the collector around their captures too."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def capture_largest_first(sizes: list[int], capture, what: str, fallback: str) -> dict:
    """``{size: capture(size)}`` for every size, largest first: the later, smaller captures reuse
    the memory pool the first one sized, with the garbage collector paused
    (:func:`collector_paused`). Any failure is logged with ``fallback`` (what runs instead) and
    leaves no graph at all."""
    start = time.perf_counter()
    graphs = {}
    try:
        with collector_paused():
            for size in reversed(sizes):
                graphs[size] = capture(size)
    except Exception:
        _log.warning("capturing CUDA %s) failed; %s", what, fallback, exc_info=True)
        graphs.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the dropped graphs' pool goes back to the device
        return {}
    _log.info("captured CUDA %s %s) in %.1f s", what, ",".join(map(str, sizes)), time.perf_counter() - start)
    return graphs


class DecodeGraphs:
    def __init__(self, runner, max_batch: int):
        self.runner = runner
        self.sizes = graph_batch_sizes(max(1, max_batch))
        self.max_batch = self.sizes[-1]
        self.inputs = runner._step_inputs(self.max_batch, self.max_batch)
        self.pool = None  # one memory pool shared by every captured graph
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def can_run(self, batch: Batch) -> bool:
        """Graphs are captured and this is a decode step (one new token per sequence) they cover."""
        return (bool(self.graphs) and 0 < batch.num_seqs <= self.max_batch and not batch.staging_tables
                and batch.num_tokens == batch.num_seqs and all(len(ids) == 1 for ids in batch.token_ids))

    @torch.no_grad()
    def capture_all(self, layout) -> None:
        """Capture every size now, largest first (later, smaller captures reuse the shared pool).

        Any failure (e.g. a shape the Triton kernels do not cover, whose reference fallback syncs
        with the host, or a kernel that does not compile) leaves no graph: the runner decodes eagerly.
        """
        self.graphs = capture_largest_first(self.sizes, lambda size: self._capture(size, layout),
                                            "decode graphs (batch sizes", "decoding eagerly")

    def run(self, batch: Batch, pending_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, vocab]`` (float32). A view of the graph's output: valid until the next step."""
        size = self.sizes[bisect.bisect_left(self.sizes, batch.num_seqs)]
        graph, logits = self.graphs[size]
        self.inputs.load(batch, pad_to=size, graph_shapes=True, pending_tokens=pending_tokens)
        self.runner.mark_forward()
        graph.replay()
        return logits[: batch.num_seqs]

    def _capture(self, size: int, layout) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up (compiles the kernels) and capture the forward of ``size`` padding sequences."""
        padding = Batch(seq_ids=[], token_ids=[], positions=[], cache_lens=[], history_lens=[], window_tables=[],
                        quant_tables=[], context_token_ids=[], layout=layout)
        inputs = self.inputs.load(padding, pad_to=size, graph_shapes=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and autotune the kernels outside the capture
            for _ in range(2):
                self.runner.forward(inputs, graph_decode=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.runner.forward(inputs, graph_decode=True).float()
        torch.cuda.synchronize()
        return graph, logits
