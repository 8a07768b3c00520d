"""Structured output below the server: the bitmask op, the xgrammar backend and the manager, and
the engine (overlapped or not, LLM level) producing output that matches its constraint."""

from __future__ import annotations

import copy
import json
import re
import sys

import pytest
import torch

from oscar_compile import CompressionSpec, apply, calibrate
from oscar_compile.runtime.core.sampling_params import RequestError, SamplingParams, StructuredOutputParams
from oscar_compile.runtime.worker.grammar_mask import apply_token_bitmask, torch_apply_token_bitmask

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from oscar_compile.runtime.engine_config import EngineConfig, build_engine  # noqa: E402
from oscar_compile.runtime.llm import LLM  # noqa: E402
from oscar_compile.runtime.structured_output import xgrammar_manager  # noqa: E402
from oscar_compile.runtime.structured_output.backend import StructuredOutputBackend  # noqa: E402
from oscar_compile.runtime.worker.compressed_runner import compressed_layout, runner_factory  # noqa: E402

# no maxLength: xgrammar 0.2.9 lets a string with maxLength hold raw control characters, which
# json.loads refuses (its plain strings are right)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100])
def test_bitmask_op_equals_the_reference(vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(3, vocab)
    width = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, width), dtype=torch.int32)
    bitmask[1] = -1  # all allowed
    bitmask[2, -1] = -(2**31)  # only the sign bit of the last word: token 32 * (W - 1) + 31
    masked = apply_token_bitmask(logits, bitmask)
    assert torch.equal(masked, torch_apply_token_bitmask(logits, bitmask))
    assert torch.equal(masked[1], logits[1])
    assert torch.isinf(masked).any() or vocab == 1


def test_bitmask_op_equals_xgrammars_own():
    logits = torch.randn(4, 70)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 3), dtype=torch.int32)
    reference = logits.clone()
    xgrammar.apply_token_bitmask_inplace(reference, bitmask)
    assert torch.equal(apply_token_bitmask(logits, bitmask), reference)


@pytest.fixture(scope="module")
def manager(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return xgrammar_manager(tokenizer, len(tokenizer) + 7, [eos])  # a padded logit width, as real models have


def _walk(manager, seq, text_ids):
    """Feed tokens one at a time, checking each was allowed by the bitmask before it."""
    for token in text_ids:
        bitmask = manager.fill_bitmask([seq])
        allowed = apply_token_bitmask(torch.zeros(1, manager.vocab_size), bitmask)[0]
        assert allowed[token] == 0, token
        manager.accept(seq, token)


def _ready(manager, seq):
    manager.add(seq)
    manager.wait(30)
    ready, failed = manager.take_ready()
    assert ready == [seq] and not failed


def test_backend_compiles_once_advances_and_terminates(manager, tokenizer):
    from oscar_compile.runtime.core.sequence import Sequence

    params = StructuredOutputParams(json=SCHEMA)
    reordered = StructuredOutputParams(json=json.dumps(dict(reversed(list(SCHEMA.items())))))
    before = manager.num_compiles
    first, second = manager.compile(params).result(30), manager.compile(reordered).result(30)
    assert first is second and manager.num_compiles == before + 1  # one compile: key order does not matter
    seq = Sequence([1], SamplingParams(structured_output=params))
    _ready(manager, seq)
    text = json.dumps({"name": "bo", "age": 3, "ok": True, "tags": ["a"]}, separators=(",", ":"))
    _walk(manager, seq, tokenizer.encode(text))
    assert not manager.is_terminated(seq)
    bitmask = manager.fill_bitmask([seq])
    allowed = apply_token_bitmask(torch.zeros(1, manager.vocab_size), bitmask)[0].isfinite().nonzero().flatten()
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert allowed.tolist() == [eos]  # complete: only the stop token; the padded ids never
    manager.accept(seq, eos)
    assert manager.is_terminated(seq)
    manager.remove(seq.seq_id)
    assert manager.fill_bitmask([seq]) is None  # no constrained row: no bitmask at all


@pytest.mark.parametrize("copies", [1, 43])  # 4 rows: one thread; 4 * 43 >= PARALLEL_FILL_ROWS: the pool
def test_the_batch_fill_equals_row_by_row(manager, tokenizer, copies):
    """xgrammar's batch fill, on one thread or on its pool, writes what each grammar writes
    alone, in its own row."""
    from oscar_compile.runtime.core.sequence import Sequence
    from oscar_compile.runtime.structured_output.backend_xgrammar import PARALLEL_FILL_ROWS

    kinds = [
        StructuredOutputParams(json=SCHEMA),
        StructuredOutputParams(regex="[0-9]+x"),
        StructuredOutputParams(choice=["ab", "cd"]),
    ]
    seqs = [Sequence([1], SamplingParams(structured_output=k)) for k in kinds * copies]
    plain = Sequence([1], SamplingParams())
    for seq in seqs:
        _ready(manager, seq)
    for i in range(0, len(seqs), 3):
        _walk(manager, seqs[i], tokenizer.encode('{"name":"'))
        _walk(manager, seqs[i + 1], tokenizer.encode("12"))
    rows = [plain, *seqs]
    assert (len(rows) >= PARALLEL_FILL_ROWS) == (copies > 1)
    batch = manager.fill_bitmask(rows)
    alone = [manager.fill_bitmask([seq]) for seq in seqs]
    assert torch.equal(batch[1:], torch.cat(alone)) and (batch[0] == -1).all()
    assert len({tuple(row.flatten().tolist()) for row in alone}) == 3
    for seq in seqs:
        manager.remove(seq.seq_id)


def test_a_refused_token_terminates_and_whitespace_is_refused(manager, tokenizer):
    from oscar_compile.runtime.core.sequence import Sequence

    seq = Sequence([1], SamplingParams(structured_output=StructuredOutputParams(json_object=True)))
    _ready(manager, seq)
    _walk(manager, seq, tokenizer.encode("{"))
    space = tokenizer.encode(" ")[0]
    bitmask = manager.fill_bitmask([seq])
    assert apply_token_bitmask(torch.zeros(1, manager.vocab_size), bitmask)[0, space] == float("-inf")
    manager.accept(seq, space)
    assert manager.is_terminated(seq)
    manager.remove(seq.seq_id)


@pytest.mark.parametrize(
    "params, param",
    [
        (StructuredOutputParams(regex="(unclosed"), "structured_outputs.regex"),
        (StructuredOutputParams(json={"type": "nonsense"}), "structured_outputs.json"),
        (StructuredOutputParams(json="{not json"), "structured_outputs.json"),
        (StructuredOutputParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
        (
            StructuredOutputParams(
                json={"type": "nonsense"},
                param="response_format.json_schema",
                value_param="response_format.json_schema.schema",
            ),
            "response_format.json_schema.schema",
        ),
    ],
)
def test_compile_errors_name_their_field(manager, params, param):
    with pytest.raises(RequestError) as info:
        manager.compile(params).result(30)
    assert info.value.param == param and str(info.value).startswith("invalid ")
    assert "/project/" not in str(info.value)  # the engine's C++ log prefix is dropped


class _GatedBackend(StructuredOutputBackend):
    """The xgrammar backend, whose compiles wait for ``gate``: a compile that takes its time."""

    def __init__(self, inner, gate):
        self.inner, self.gate = inner, gate

    def compile(self, params):
        assert self.gate.wait(30)
        return self.inner.compile(params)

    def new_grammar(self, compiled):
        return self.inner.new_grammar(compiled)


def test_a_request_waits_for_its_compile_and_can_be_aborted_meanwhile(tiny_model, tokenizer):
    import threading

    from oscar_compile.runtime.core.sequence import SequenceStatus
    from oscar_compile.runtime.structured_output import StructuredOutputManager
    from oscar_compile.runtime.structured_output.backend_xgrammar import XgrammarBackend

    gate = threading.Event()
    vocab = len(tokenizer)
    manager = StructuredOutputManager(lambda: _GatedBackend(XgrammarBackend(tokenizer, vocab, [0]), gate), vocab)
    engine = build_engine(tiny_model, tokenizer, EngineConfig(num_window_pages=0, num_quant_pages=256))
    engine._structured = manager  # build_engine takes no manager; the engine's own would not wait
    regex = StructuredOutputParams(regex="[a-z]{4}")
    waiting = engine.add_request([5, 6], SamplingParams(max_tokens=8, temperature=0.0, structured_output=regex))
    aborted = engine.add_request([7, 8], SamplingParams(max_tokens=8, structured_output=regex))
    plain = engine.add_request([9, 10], SamplingParams(max_tokens=3, temperature=0.0))
    while not plain.is_finished:
        engine.step()
    assert waiting.status is SequenceStatus.WAITING and waiting.num_output_tokens == 0 and not waiting.has_pages
    [out] = engine.abort_request(aborted.request_id)
    assert out.finish_reason == "abort" and manager.num_waiting == 1
    assert engine.has_unfinished() and engine.stats()["num_waiting"] == 1  # counted for admission
    gate.set()
    while engine.has_unfinished():
        engine.step()
    assert re.fullmatch("[a-z]{4}", waiting.detokenizer.text) and waiting.finish_reason.value == "stop"
    manager.shutdown()


@pytest.fixture(scope="module")
def bundled_llm():
    from oscar_compile.loading import BUNDLED_MODEL_DIR

    if not (BUNDLED_MODEL_DIR / "config.json").exists():
        pytest.skip("the bundled model is not shipped")
    return LLM(str(BUNDLED_MODEL_DIR), device="cpu", dtype=torch.float32)


def test_llm_outputs_match_their_constraints_and_a_bad_one_fails_alone(bundled_llm):
    choices = ["yes", "no way", 'say "hi"']
    params = [
        SamplingParams(max_tokens=120, temperature=0.0, structured_output=StructuredOutputParams(json=SCHEMA)),
        SamplingParams(
            max_tokens=20, temperature=0.9, seed=3, structured_output=StructuredOutputParams(choice=choices)
        ),
        SamplingParams(
            max_tokens=12, temperature=0.0, structured_output=StructuredOutputParams(regex="[0-9]{3}-[a-z]{2}")
        ),
        SamplingParams(max_tokens=6, temperature=0.0, structured_output=StructuredOutputParams(regex="(")),
        SamplingParams(max_tokens=6, temperature=0.0),
    ]
    prompts = ["A user as JSON:", "Answer:", "Code:", "x", "def f():"]
    out = [o.outputs[0] for o in bundled_llm.generate(prompts, params)]
    jsonschema.validate(json.loads(out[0].text), SCHEMA)
    assert out[0].finish_reason == "stop"
    assert out[0].text == json.dumps(json.loads(out[0].text), separators=(",", ":"), ensure_ascii=False)  # compact
    assert out[1].text in choices and out[1].finish_reason == "stop"
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", out[2].text) and out[2].finish_reason == "stop"
    assert out[3].finish_reason == "abort" and out[3].error.param == "structured_outputs.regex"
    plain = bundled_llm.generate(prompts[4:], params[4:])[0].outputs[0]
    assert out[4].token_ids == plain.token_ids and out[4].error is None  # a neighbour's grammar changes nothing
    # logprobs stay the model's own, before the mask: the same as an unconstrained run's on those tokens
    constrained = bundled_llm.generate(
        ["A user as JSON:"],
        SamplingParams(
            max_tokens=5, temperature=0.0, logprobs=0, structured_output=StructuredOutputParams(json=SCHEMA)
        ),
    )[0].outputs[0]
    forced = bundled_llm.engine.tokenizer.encode("A user as JSON:") + constrained.token_ids[:-1]
    with torch.no_grad():
        logits = bundled_llm.model(torch.tensor([forced])).logits[0].float().log_softmax(-1)
    num_prompt = len(forced) - len(constrained.token_ids) + 1
    own = logits[num_prompt - 1 :].gather(1, torch.tensor(constrained.token_ids)[:, None])[:, 0]
    assert [lp.logprob for lp in constrained.logprobs] == pytest.approx(own.tolist(), abs=1e-4)


BF16 = CompressionSpec.from_dict(
    {"kv_cache": {"bits": 16, "page_size": 4}, "key": {"rotation": "none"}, "value": {"rotation": "none"}}
)


def test_overlapped_steps_give_the_constrained_outputs_of_plain_steps(tiny_model, tokenizer):
    """The compressed runner on the CPU runs the overlapped order (the forward queued before the
    previous sample is read, the grammars advanced, then the masked sampling): same outputs as
    one step at a time, for a batch mixing constrained and plain rows."""
    model = copy.deepcopy(tiny_model)
    compressed = apply(model, BF16, calibrate(model, BF16))
    layout = compressed_layout(model, BF16)
    choices = ["alpha", "beta gamma"]
    requests = [
        (
            [5, 6, 7],
            SamplingParams(max_tokens=60, temperature=0.0, structured_output=StructuredOutputParams(json=SCHEMA)),
        ),
        ([8, 9], SamplingParams(max_tokens=10, temperature=0.0)),
        (
            [10, 11, 12, 13],
            SamplingParams(
                max_tokens=10, temperature=1.0, seed=7, structured_output=StructuredOutputParams(choice=choices)
            ),
        ),
    ]
    results = {}
    for overlap in (True, False):
        cfg = EngineConfig(layout=layout, overlap_steps=overlap)
        engine = build_engine(model, tokenizer, cfg, make_runner=runner_factory(compressed, layout, cfg))
        assert engine.overlap is overlap
        seqs = [engine.add_request(list(ids), params) for ids, params in requests]
        while engine.has_unfinished():
            engine.step()
        results[overlap] = [(s.output_token_ids, s.finish_reason.value, s.detokenizer.text) for s in seqs]
        assert engine.page_manager.window_pool.num_used == 0
    assert results[True] == results[False]
    (json_ids, json_reason, json_text), _, (_, choice_reason, choice_text) = results[True]
    if json_reason == "stop":
        jsonschema.validate(json.loads(json_text), SCHEMA)
    else:  # a random 64-wide model may ramble inside a string: then it must still be a prefix of valid JSON
        assert json_reason == "length" and json_text.startswith('{"name":"')
    assert choice_text in choices and choice_reason == "stop"


def _counting(run, calls: list):
    def counted(batch, *pending):
        calls.append(batch.num_seqs)
        return run(batch, *pending)

    return counted


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_structured_output_on_cuda_with_overlapped_steps_and_cuda_graphs():
    """On the GPU (decode steps replayed from CUDA graphs, overlapped steps: the mask of step t+1
    filled while its forward runs, after the grammars took token t) a batch mixing constrained
    and plain requests gives the tokens of one-step-at-a-time stepping, and valid output."""
    from oscar_compile.loading import BUNDLED_MODEL_DIR
    from oscar_compile.spec import specs_dir

    if not (BUNDLED_MODEL_DIR / "config.json").exists():
        pytest.skip("the bundled model is not shipped")
    choices = ["red", "green", "dark blue"]
    prompts = ["A user as JSON:", "import os\n", "Colour:", "Code:", "A user as JSON:"]
    params = [
        SamplingParams(max_tokens=150, temperature=0.0, structured_output=StructuredOutputParams(json=SCHEMA)),
        SamplingParams(max_tokens=30, temperature=0.0),
        SamplingParams(
            max_tokens=10, temperature=0.8, seed=4, structured_output=StructuredOutputParams(choice=choices)
        ),
        SamplingParams(
            max_tokens=12, temperature=0.0, structured_output=StructuredOutputParams(regex="[0-9]{3}-[a-z]{2}")
        ),
        SamplingParams(max_tokens=150, temperature=0.7, seed=9, structured_output=StructuredOutputParams(json=SCHEMA)),
    ]
    outputs = {}
    for overlap in (True, False):
        llm = LLM(str(BUNDLED_MODEL_DIR), str(specs_dir() / "oscar-int2.yaml"),
                  str(BUNDLED_MODEL_DIR / "rotations" / "oscar-int2.safetensors"), device="cuda",
                  config=EngineConfig(overlap_steps=overlap))
        assert llm.engine.overlap is overlap and llm.engine.runner.graphs is not None
        replays = []
        run = llm.engine.runner.graphs.run
        llm.engine.runner.graphs.run = _counting(run, replays)
        choices = [o.outputs[0] for o in llm.generate(prompts, params)]
        outputs[overlap] = [(c.token_ids, c.finish_reason, c.text) for c in choices]
        assert replays  # the decode steps ran from CUDA graphs
        plain = llm.generate(prompts[1:2], params[1])[0].outputs[0].token_ids
        llm.close()
    assert outputs[True] == outputs[False]
    (_, r0, t0), (ids1, _, _), (_, r2, t2), (_, r3, t3), (_, r4, t4) = outputs[True]
    assert ids1 == plain  # the plain neighbour is untouched by the masks
    for reason, text in ((r0, t0), (r4, t4)):
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    assert r2 == "stop" and t2 in choices
    assert r3 == "stop" and re.fullmatch("[0-9]{3}-[a-z]{2}", t3)


def test_a_missing_grammar_engine_is_the_servers_error_and_is_not_cached(tokenizer, monkeypatch):
    """Without xgrammar a constraint fails as GrammarEngineUnavailable (501, not the client's 400);
    once it is installed the same constraint compiles, with no restart."""
    from oscar_compile.runtime.structured_output import GrammarEngineUnavailable, grammar_engine_installed

    manager = xgrammar_manager(tokenizer, len(tokenizer))
    params = StructuredOutputParams(json=SCHEMA)
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    assert not grammar_engine_installed()
    with pytest.raises(GrammarEngineUnavailable, match=r"oscar-compile\[serve\]"):
        manager.compile(params).result(30)
    monkeypatch.undo()  # "pip install" done
    assert grammar_engine_installed()
    assert manager.compile(params).result(30) is not None
    manager.shutdown()
