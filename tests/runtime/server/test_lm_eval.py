"""lm-eval 0.4.13 end to end against the served bundled model (issue 30, "Tests (CPU, in CI)").

``lm_eval.simple_evaluate`` with ``local-completions`` (the model built from the same
``model_args`` string the README's ``lm_eval`` command passes) on two local tasks written to
``tmp_path`` (``dataset_path: json``): a multiple-choice loglikelihood task and a
``generate_until`` task with 6 stop strings. Both tasks run in every setting of the matrix
``tokenizer_backend`` huggingface / remote / auto x ``num_concurrent`` 1 / 2 (six evaluations,
one server).

What is checked, per setting:
- every loglikelihood lm-eval logged (``log_samples``) equals the served model's own
  teacher-forced sum over the same continuation tokens, and its ``is_greedy`` the argmax check;
- ``auto`` resolved to ``remote`` (the server has ``/tokenizer_info`` and ``/tokenize``), and the
  remote backends tokenized through the server (``POST /tokenize`` seen on the wire);
- the ``stop`` lists on the wire: the task's 6 strings, plus the eos string (``<|endoftext|>``)
  on the synchronous path only (``num_concurrent`` 1): lm-eval's ``amodel_call`` passes no eos;
- each generation is what the server returns for the same request sent alone, and equals the
  stop-less generation of the same prompt cut before its first stop string.

And ``local-chat-completions`` with ``apply_chat_template`` on the ``generate_until`` task (two
documents, to keep CI short): its bodies equal the fixture captured from the real client
(fixtures/lm_eval_0.4.13_chat.json) and its generations the server's answers.

Nothing is downloaded: the task data are local JSON files, the tokenizer is the bundled folder
(or the server's routes), and the hub is off (``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before datasets / huggingface_hub read them
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("uvicorn")
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import RemoteTokenizer  # noqa: E402
from server_http import post, running  # noqa: E402

from oscar_compile.assembly import assemble  # noqa: E402
from oscar_compile.loading import BUNDLED_MODEL_DIR  # noqa: E402
from oscar_compile.runtime.async_engine import AsyncEngine  # noqa: E402
from oscar_compile.runtime.engine_config import EngineConfig  # noqa: E402
from oscar_compile.runtime.server.app import create_app  # noqa: E402
from oscar_compile.spec import specs_dir  # noqa: E402

MODEL = "oscar-tiny"
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 6: more than OpenAI's 4, as lm-eval's code tasks send. The ones the generations meet come after
# the 4th, so that a server keeping only 4 would fail the cut check.
STOPS = ["!", "?", ";", ".", "\n", "("]
EOS = "<|endoftext|>"
MAX_GEN_TOKS = 24

MC_DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "a dog"], "answer": 0},
    {"question": "Once upon a time there was", "choices": ["a little girl", "a dog", "7 8 9"], "answer": 0},
    {"question": "1 2 3 4", "choices": ["5 6 7 8", "a b c", "the end"], "answer": 0},
    {"question": "Lily went to the park with her", "choices": ["mom", "car", "sky"], "answer": 0},
]
# lm-eval sends no BOS, and without one the bundled 19M model mostly repeats a word; these prompts
# (found by greedy decoding) run into a stop string within MAX_GEN_TOKS: "\n", "." and "(" (the
# last one runs to the token limit).
GEN_DOCS = [
    {"prompt": "import os\nimport", "target": " sys"},
    {"prompt": "Once upon a time, there was a little girl named Lily. She", "target": " liked"},
    {"prompt": "x = [1, 2, 3]\n", "target": "y"},
    {"prompt": "This function returns", "target": " None"},
]

MC_YAML = """\
task: oscar_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_YAML = """\
task: oscar_local_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: {stops}
  max_gen_toks: {max_gen_toks}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""

# Tolerance of a loglikelihood against the teacher-forced sum. Both are float32 on the same
# weights, but the server computes the prompt's log-softmax in its own chunked prefill (8-token
# steps, batched with the other prompts of the request) while the reference is one forward of the
# whole sequence: the matmuls reduce in a different order, an ulp-level difference per logit
# (observed up to 4e-5 on a sum of about -60, tests/runtime/server/fixtures/check_lm_eval_e2e.py). 1e-6
# relative (float32's 1e-7 times the few reductions) plus 1e-4 absolute covers it with margin; an
# off-by-one token, a dropped choice or a wrong context split moves a sum by whole nats.
REL, ABS = 1e-6, 1e-4


def write_tasks(root) -> None:
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / "oscar_local_mc.yaml").write_text(MC_YAML.format(data=root / "mc.jsonl"))
    (root / "oscar_local_gen.yaml").write_text(
        GEN_YAML.format(data=root / "gen.jsonl", stops=json.dumps(STOPS), max_gen_toks=MAX_GEN_TOKS))


class Recorder:
    """ASGI wrapper that keeps (path, JSON body) of every POST: what lm-eval put on the wire."""

    def __init__(self, app):
        self.app, self.seen = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        self.seen.append((scope["path"], json.loads(body or b"null")))
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)


def serve():
    """(the recorded app, the assembled engine): the bundled model as ``serve`` serves it
    (oscar-int2 spec and shipped rotations), with an 8-token step budget so that prompts are
    prefilled in chunks."""
    config = EngineConfig(kv_memory_gb=0.05, max_num_seqs=4, max_num_batched_tokens=8)
    built = assemble(BUNDLED_MODEL_DIR, str(specs_dir() / "oscar-int2.yaml"),
                     str(BUNDLED_MODEL_DIR / "rotations" / "oscar-int2.safetensors"), device="cpu", config=config)
    return Recorder(create_app(AsyncEngine(built.engine), MODEL)), built


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    app, built = serve()
    tasks = tmp_path_factory.mktemp("lm_eval_tasks")
    write_tasks(tasks)
    # lm-eval's built-in tasks stay out of the index: building it reads thousands of YAML files (~30 s).
    task_manager = TaskManager(include_path=str(tasks), include_defaults=False)
    with running(app) as port:
        yield port, built, app, task_manager


def model_args(port: int, backend: str, num_concurrent: int) -> str:
    """The README command's ``--model_args``; the bundled folder is the tokenizer only for the
    huggingface backend (lm-eval loads a given ``tokenizer`` with transformers whatever the backend)."""
    args = f"base_url=http://127.0.0.1:{port}/v1/completions,model={MODEL},num_concurrent={num_concurrent}," \
           "tokenized_requests=True,max_retries=1,timeout=60"
    if backend != "auto":  # auto: lm-eval's default, not passed
        args += f",tokenizer_backend={backend}"
    if backend == "huggingface":
        args += f",tokenizer={BUNDLED_MODEL_DIR}"
    return args


def chat_model(port: int):
    """lm-eval's ``local-chat-completions`` as the README's chat command builds it: no tokenizer on
    the client (the server renders the messages with the model's chat template)."""
    args = f"base_url=http://127.0.0.1:{port}/v1/chat/completions,model={MODEL},num_concurrent=1,max_retries=1,timeout=60"
    return get_model("local-chat-completions").create_from_arg_string(args, {})


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's ``TemplateLM._encode_pair``: trailing spaces of the context move to the
    continuation, the pair is encoded whole (no special tokens) and split at the context's length."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def teacher_forced(built, context: str, continuation: str) -> tuple[float, bool]:
    """The served (rewritten) model's one-shot forward on context + continuation: the sum of the
    continuation tokens' log-softmax, and whether each is the argmax."""
    ctx, cont = encode_pair(built.tokenizer, context, continuation)
    ids = ctx + cont
    with torch.no_grad():
        lp = torch.log_softmax(built.model(torch.tensor([ids]), use_cache=True).logits[0].float(), -1)
    positions = range(len(ctx), len(ids))
    return (sum(lp[p - 1, ids[p]].item() for p in positions),
            all(lp[p - 1].argmax().item() == ids[p] for p in positions))


_answers: dict[str, str] = {}


def server_text(port: int, request: dict) -> str:
    """The server's text for ``request`` sent alone (greedy, so asked once per distinct request)."""
    key = json.dumps(request, sort_keys=True)
    if key not in _answers:
        status, body = post(port, "/v1/completions", request)
        assert status == 200, body
        _answers[key] = body["choices"][0]["text"]
    return _answers[key]


def cut_at_stops(text: str, stops: list[str]) -> str:
    return text[:min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))]


@pytest.mark.parametrize("num_concurrent", [1, 2])
@pytest.mark.parametrize("backend", ["huggingface", "remote", "auto"])
def test_lm_eval_local_completions(served, backend, num_concurrent):
    port, built, recorder, task_manager = served
    lm = get_model("local-completions").create_from_arg_string(
        model_args(port, backend, num_concurrent), {"batch_size": 2})
    if backend == "huggingface":
        assert lm.tokenizer_backend == "huggingface" and not isinstance(lm.tokenizer, RemoteTokenizer)
    else:  # auto probes /tokenizer_info and /tokenize, finds them, and picks remote
        assert lm.tokenizer_backend == "remote" and isinstance(lm.tokenizer, RemoteTokenizer)
    recorder.seen.clear()
    out = lm_eval.simple_evaluate(model=lm, tasks=["oscar_local_mc", "oscar_local_gen"],
                                  task_manager=task_manager, log_samples=True,
                                  random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    seen = list(recorder.seen)
    if backend != "huggingface":
        assert any(path == "/tokenize" for path, _ in seen), "the remote backend did not tokenize on the server"

    # Loglikelihoods: every (context, continuation) lm-eval scored, against the teacher-forced sum.
    samples = out["samples"]["oscar_local_mc"]
    assert len(samples) == len(MC_DOCS)
    for sample in samples:
        doc = sample["doc"]
        assert [c for _, c in sample["arguments"]] == [" " + choice for choice in doc["choices"]]
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            score, greedy = resp[0]
            ref, ref_greedy = teacher_forced(built, context, continuation)
            assert score == pytest.approx(ref, rel=REL, abs=ABS), (context, continuation)
            assert greedy == ref_greedy, (context, continuation)
    assert "acc,none" in out["results"]["oscar_local_mc"]

    # The scoring requests are lm-eval's echo + logprobs bodies, prompts as token lists.
    scoring = [body for path, body in seen if path == "/v1/completions" and body.get("echo")]
    assert scoring and all(b["max_tokens"] == 1 and b["logprobs"] == 1 for b in scoring)
    assert all(isinstance(p, list) and all(isinstance(t, int) for t in p) for b in scoring for p in b["prompt"])
    # ... and the token ids are the bundled tokenizer's, whichever backend encoded them.
    expected = sorted(sum(encode_pair(built.tokenizer, *args), []) for s in samples for args in s["arguments"])
    assert sorted(p for b in scoring for p in b["prompt"]) == expected

    # Generations: the stop lists on the wire, then the texts against the server's own answers.
    generating = [body for path, body in seen if path == "/v1/completions" and not body.get("echo")]
    expected_stops = STOPS + [EOS] if num_concurrent == 1 else STOPS
    assert generating and all(b["stop"] == expected_stops for b in generating), [b["stop"] for b in generating]
    gen_samples = out["samples"]["oscar_local_gen"]
    assert len(gen_samples) == len(GEN_DOCS)
    cut = 0
    for sample in gen_samples:
        prompt_text = sample["arguments"][0][0]
        text = sample["resps"][0][0]
        ids = built.tokenizer.encode(prompt_text, add_special_tokens=False)
        request = {"model": MODEL, "prompt": [ids], "max_tokens": MAX_GEN_TOKS, "temperature": 0, "seed": 1234}
        assert text == server_text(port, {**request, "stop": expected_stops})
        full = server_text(port, request)
        assert text == cut_at_stops(full, expected_stops), (text, full)
        assert not any(s in text for s in expected_stops)
        cut += text != full
    assert cut, "no generation met a stop string: the stop list was not exercised"


CHAT_FIXTURE = Path(__file__).parent / "fixtures" / "lm_eval_0.4.13_chat.json"
CHAT_DOCS = 2  # of GEN_DOCS: each generation costs about 2 s on the CPU


def test_lm_eval_local_chat_completions(served):
    """A ``generate_until`` task through ``local-chat-completions`` with ``apply_chat_template``:
    the bodies on the wire are the captured fixture's (fixtures/capture_lm_eval_chat.py), and each
    generation is what the server answers that body sent alone, the messages rendered through the
    model's chat template."""
    port, built, recorder, task_manager = served
    chat_body = json.loads(CHAT_FIXTURE.read_text())
    recorder.seen.clear()
    out = lm_eval.simple_evaluate(model=chat_model(port), tasks=["oscar_local_gen"], apply_chat_template=True,
                                  limit=CHAT_DOCS, task_manager=task_manager, log_samples=True,
                                  random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    bodies = [body for path, body in recorder.seen if path == "/v1/chat/completions"]
    assert len(bodies) == CHAT_DOCS and bodies[0] == chat_body
    for body, doc in zip(bodies, GEN_DOCS, strict=False):
        # lm-eval keeps 4 stop strings on chat (``stop[:4]``) and, with no client tokenizer, adds no eos
        assert body == {**chat_body, "messages": [{"role": "user", "content": doc["prompt"]}]}
    assert chat_body["stop"] == STOPS[:4] and chat_body["max_tokens"] == MAX_GEN_TOKS
    samples = out["samples"]["oscar_local_gen"]
    for body, sample in zip(bodies, samples, strict=True):
        status, reply = post(port, "/v1/chat/completions", body)
        assert status == 200, reply
        assert sample["resps"][0][0] == reply["choices"][0]["message"]["content"]
        rendered = built.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, return_dict=False)
        assert reply["usage"]["prompt_tokens"] == len(rendered)
