"""The CUDA-graph decode path's bookkeeping, run on the CPU with a stand-in for graph replay.

A captured graph replays its kernels on the tensors it was captured with. The stand-in does the
same thing in Python: it keeps the forward and re-runs it on the captured (static) input tensors,
writing into the captured output. So this checks what the GPU tests cannot show on a CPU machine:
that every step's inputs land in the captured storage, that padding rows (batches between
captured sizes) touch only the scratch pages, and that capture itself leaves the cache alone.
"""
import copy

from oscar_compile import CompressionSpec, calibrate
from oscar_compile.runtime import LLM, SamplingParams
from oscar_compile.runtime.engine_config import EngineConfig
from oscar_compile.runtime.worker.cuda_graphs import DecodeGraphs

SPEC = CompressionSpec.from_dict({
    "kv_cache": {"bits": 2, "group_size": 16, "sink_tokens": 4, "recent_tokens": 8, "page_size": 4},
    "key": {"center": True},
})


class ReplayInPython:
    def __init__(self, forward):
        self.forward = forward
        self.output = forward()

    def replay(self):
        self.output.copy_(self.forward())


def _capture_in_python(graphs: DecodeGraphs):
    def capture(size, layout):
        from oscar_compile.runtime.worker.runner import Batch

        padding = Batch(seq_ids=[], token_ids=[], positions=[], cache_lens=[], history_lens=[], window_tables=[],
                        quant_tables=[], context_token_ids=[], layout=layout)
        inputs = graphs.inputs.load(padding, pad_to=size, graph_shapes=True)
        graph = ReplayInPython(lambda: graphs.runner.forward(inputs).float())
        return graph, graph.output

    return capture


def test_graph_path_equals_eager_decoding(tokenizer, tiny_model):
    import torch

    rot = calibrate(tiny_model, SPEC, [torch.randint(0, len(tokenizer), (2, 48),
                                                     generator=torch.Generator().manual_seed(0))])
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, len(tokenizer), (n,), generator=g).tolist() for n in (5, 23, 40, 9, 31)]
    # different lengths: the batch shrinks 5 -> 1 through the captured sizes 8, 4, 2, 1
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (12, 20, 8, 16, 4)]
    outputs = []
    for graphed in (False, True):
        config = EngineConfig(num_window_pages=64, num_quant_pages=64, max_num_batched_tokens=256, max_num_seqs=8)
        llm = LLM(copy.deepcopy(tiny_model), spec=SPEC, rotations=rot, tokenizer=tokenizer, config=config)
        runner = llm.engine.runner
        if graphed:
            graphs = DecodeGraphs(runner, 8)
            graphs._capture = _capture_in_python(graphs)
            graphs.capture_all(runner.layout)
            assert sorted(graphs.graphs) == [1, 2, 4, 8]
            runner.graphs = graphs
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        pools = (llm.engine.page_manager.window_pool, llm.engine.page_manager.quant_pool)
        assert all(pool.num_used == 0 for pool in pools)
    assert outputs[0] == outputs[1]


def test_graphs_are_captured_with_the_garbage_collector_paused_after_a_full_pass():
    """A dead engine's graphs freed by a collection inside a capture invalidate it (an H200 test
    engine fell back to eager decoding): cycles dead before the captures are collected first,
    none during them, and the collector is back on after, also when a capture fails."""
    import gc

    import pytest

    from oscar_compile.runtime.worker.cuda_graphs import capture_largest_first, collector_paused

    freed = []

    class Dead:  # a reference cycle, as an engine dropped with its graphs
        def __init__(self, name):
            self.me, self.name = self, name

        def __del__(self):
            freed.append(self.name)

    Dead("before")
    seen = []

    def capture(size):
        seen.append((size, gc.isenabled(), list(freed)))
        Dead(f"during {size}")
        return size

    assert gc.isenabled()
    assert capture_largest_first([1, 2, 4], capture, "test graphs (sizes", "eager") == {4: 4, 2: 2, 1: 1}
    assert seen == [(4, False, ["before"]), (2, False, ["before"]), (1, False, ["before"])]
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("a capture failed")
    assert gc.isenabled()
    gc.collect()
    assert sorted(freed) == ["before", "during 1", "during 2", "during 4"]
