"""Piecewise graphs of prefill and mixed steps (worker/piecewise_graphs.py), on the CPU with a
stand-in for replay: the pieces' forward runs on the static buffers as a capture would record it,
and each layer's attention runs from them as a replay runs it between the pieces (the real
step's StepCache and the layer's attention core). What the GPU cannot show a CPU machine is
checked here: the static tokens, rows and q / k / v / output buffers, the padding tokens, the
attention cores copied out of the graphs, snapshots taken inside a piecewise step."""
import copy

import pytest
import torch
from torch import fx

from oscar_compile import CompressionSpec, calibrate
from oscar_compile.cache import nodes
from oscar_compile.cache.attention_core import graph_attention_core
from oscar_compile.runtime import LLM, SamplingParams
from oscar_compile.runtime.engine_config import EngineConfig
from oscar_compile.runtime.worker.piecewise_graphs import PiecewiseGraphs, piecewise_sizes

INT2 = CompressionSpec.from_dict({
    "kv_cache": {"bits": 2, "group_size": 16, "sink_tokens": 4, "recent_tokens": 8, "page_size": 4},
    "key": {"center": True},
})
BF16 = CompressionSpec.from_dict({"kv_cache": {"bits": 16, "page_size": 4}, "key": {"rotation": "none"},
                                  "value": {"rotation": "none"}})


def test_sizes_climb_a_ladder_to_the_bound():
    assert piecewise_sizes(2048, 544) == [16, 32, 64, 128, 256, 384, 512, 544]
    assert piecewise_sizes(100, 8192) == [16, 32, 64, 100]
    assert piecewise_sizes(2048, 8192)[-3:] == [1024, 1536, 2048]
    assert piecewise_sizes(1, 8192) == [] and piecewise_sizes(0, 8192) == []


def test_a_core_is_refused_when_its_calls_read_what_came_before():
    graph = fx.Graph()
    cache, q, k, v = (graph.placeholder(name) for name in ("cache", "q", "k", "v"))
    inputs = graph.call_function(nodes.layer_inputs, (cache, 3, q, k, v))
    first = graph.call_function(torch.ops.aten.select.int, (inputs, 0, 0))
    out = graph.call_function(torch.add, (first, q))  # reads q, made before the first node
    graph.output(graph.call_function(nodes.layer_outputs, (cache, 3, out, q)))
    assert graph_attention_core(graph) is None
    out.args = (first, first)
    index, core = graph_attention_core(graph)
    assert index == 3 and [n.op for n in core.graph.nodes] == ["placeholder", "call_function", "call_function",
                                                               "output"]


def _replay_in_python(graphs: PiecewiseGraphs):
    """Capture nothing; replay = the forward of the padded size, each layer's attention the real step's."""
    graphs.forward(graphs.sizes[-1])  # the warm-up: buffers made, layers recorded
    graphs.graphs = {size: None for size in graphs.sizes}
    graphs.replay = lambda size, step, n: graphs.forward(size, step=(step, n))


def _counted(run, used: list):
    def counted(batch, pending=None):
        used.append((batch.num_tokens, bool(batch.snapshot_takes)))
        return run(batch, pending)
    return counted


@pytest.mark.parametrize("spec,semantics", [(INT2, "decode-consistent"), (INT2, "prompt-exact"),
                                           (BF16, "decode-consistent")], ids=["int2", "int2-prompt-exact", "bf16"])
def test_piecewise_steps_equal_eager_steps(tokenizer, tiny_model, spec, semantics):
    """Decode-consistent INT2 layers attend in the step's cache; prompt-exact INT2 layers (no
    staging pages: the graph's own ops) and BF16 layers through their attention cores."""
    rot = calibrate(tiny_model, spec, [torch.randint(0, len(tokenizer), (2, 48),
                                                     generator=torch.Generator().manual_seed(0))])
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, len(tokenizer), (n,), generator=g).tolist() for n in (5, 23, 40, 9, 31)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2) for m in (12, 20, 8, 16, 4)]
    results, used = [], []  # used: (tokens, takes snapshots?) of each piecewise step
    for piecewise in (False, True):
        # a budget of 24 tokens: chunked prompts beside decode rows (mixed steps), padded to 16 or 24;
        # window snapshots every 8 tokens, taken inside the chunks
        config = EngineConfig(num_window_pages=64, num_quant_pages=64, max_num_batched_tokens=24, max_num_seqs=8,
                              snapshot_interval=8, prefill_semantics=semantics, num_staging_pages=0)
        llm = LLM(copy.deepcopy(tiny_model), spec=spec, rotations=rot, tokenizer=tokenizer, config=config)
        runner = llm.engine.runner
        assert sorted(runner.attention_cores) == list(range(runner.num_layers))
        if piecewise:
            graphs = PiecewiseGraphs(runner, max_tokens=2048, max_rows=8)
            assert graphs.sizes == [16, 24]
            _replay_in_python(graphs)
            graphs.run = _counted(graphs.run, used)
            runner.piecewise = graphs
        outs = llm.generate(prompts, params)
        results.append([(o.outputs[0].token_ids,
                         [[lp.logprob] + [x for _, x in lp.top] for lp in o.outputs[0].logprobs]) for o in outs])
    # chunks and padded steps went through it, and (windowed layers) steps taking snapshots
    assert any(n > 8 for n, _ in used) and any(n < 16 for n, _ in used)
    assert any(takes for _, takes in used) == (spec is INT2 and semantics == "decode-consistent")
    for (tokens, logprobs), (tokens_pw, logprobs_pw) in zip(*results, strict=True):
        assert tokens == tokens_pw
        for a, b in zip(logprobs, logprobs_pw, strict=True):
            assert a == pytest.approx(b, abs=1e-4)
