"""Prompt scoring over HTTP: the body lm-eval 0.4.13's ``local-completions`` sends for
loglikelihood requests (captured from the real client: fixtures/capture_lm_eval.py), answered
with the numbers of the model's teacher-forced forward.

The bundled model, served as ``serve`` does (the shipped oscar-int2 spec and rotations, and
bf16), with a step budget of 4 tokens: its 11-token prompts are prefilled in 3 chunks. The
reference is the served (rewritten) model's own one-shot forward, which reads the cache under the
engine's prefill semantics (the default, decode-consistent): chunking changes no prompt logprob.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("uvicorn")

from server_http import post, running, stream_events  # noqa: E402

from oscar_compile.assembly import assemble  # noqa: E402
from oscar_compile.loading import BUNDLED_MODEL_DIR  # noqa: E402
from oscar_compile.runtime.async_engine import AsyncEngine  # noqa: E402
from oscar_compile.runtime.engine_config import EngineConfig  # noqa: E402
from oscar_compile.runtime.server.app import create_app  # noqa: E402
from oscar_compile.spec import specs_dir  # noqa: E402

LM_EVAL_BODY = json.loads((Path(__file__).parent / "fixtures" / "lm_eval_0.4.13_loglikelihood.json").read_text())
MODEL = "oscar-tiny"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["oscar-int2", "bf16"])
def served(request):
    spec = specs_dir() / f"{request.param}.yaml"
    shipped = BUNDLED_MODEL_DIR / "rotations" / f"{request.param}.safetensors"
    config = EngineConfig(kv_memory_gb=0.05, max_num_seqs=4, max_num_batched_tokens=4)
    built = assemble(BUNDLED_MODEL_DIR, str(spec), str(shipped) if shipped.is_file() else None, device="cpu",
                     config=config)
    with running(create_app(AsyncEngine(built.engine), MODEL)) as port:
        yield port, built


def _teacher_forced(model, prompt: list[int]) -> torch.Tensor:
    """[T - 1, V] float32: log_softmax of the served model's logits at positions 0 .. T - 2."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), use_cache=True).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def _parse_like_lm_eval(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm_eval/models/openai_completions.py ``parse_logprobs`` (0.4.13), line for line."""
    logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
    tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    is_greedy = True
    for tok, top in zip(tokens_logprobs, top_logprobs, strict=False):
        if tok != max(top.values()):
            is_greedy = False
            break
    return logprobs, is_greedy


def test_lm_eval_loglikelihood_body_gets_the_teacher_forced_numbers(served):
    port, built = served
    status, body = post(port, "/v1/completions", LM_EVAL_BODY)
    assert status == 200, body
    prompts = LM_EVAL_BODY["prompt"]
    assert [c["index"] for c in body["choices"]] == list(range(len(prompts)))
    ctxlen = 9  # the shared context " The capital of France is"; the continuations differ after it
    assert prompts[0][:ctxlen] == prompts[1][:ctxlen] and prompts[0][ctxlen] != prompts[1][ctxlen]
    for prompt, choice in zip(prompts, body["choices"], strict=True):
        expected = _teacher_forced(built.model, prompt)
        lp = choice["logprobs"]
        n = len(prompt)
        assert [len(lp[key]) for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")] == [n + 1] * 4
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][:n] == [built.tokenizer.decode([t]) for t in prompt]
        assert choice["text"].startswith(built.tokenizer.decode(prompt))
        want = [expected[p, prompt[p + 1]].item() for p in range(n - 1)]
        assert lp["token_logprobs"][1:n] == pytest.approx(want, abs=1e-4)
        for p in range(1, n):  # greedy exactly when the model's argmax is the prompt token: bitwise
            is_top = expected[p - 1].argmax().item() == prompt[p]
            assert (lp["token_logprobs"][p] == max(lp["top_logprobs"][p].values())) == is_top
        score, greedy = _parse_like_lm_eval(choice, ctxlen)
        assert score == pytest.approx(sum(want[ctxlen - 1:]), abs=1e-4)
        assert greedy == all(expected[p - 1].argmax().item() == prompt[p] for p in range(ctxlen, n))
    assert body["usage"]["completion_tokens"] == len(prompts)


def test_max_tokens_0_echoes_the_prompt_only(served):
    port, built = served
    prompt = LM_EVAL_BODY["prompt"][0]
    status, body = post(port, "/v1/completions", {**LM_EVAL_BODY, "prompt": prompt, "max_tokens": 0, "logprobs": 2})
    assert status == 200, body
    (choice,) = body["choices"]
    assert choice["text"] == built.tokenizer.decode(prompt) and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(prompt) and body["usage"]["completion_tokens"] == 0
    assert all(len(top) in (2, 3) for top in lp["top_logprobs"][1:])  # the 2 best and the token itself
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(prompt))]


def test_prompt_logprobs_on_both_routes_in_vllms_shape(served):
    port, built = served
    prompt = LM_EVAL_BODY["prompt"][1]
    expected = _teacher_forced(built.model, prompt)
    status, body = post(port, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                  "temperature": 0, "prompt_logprobs": 2})
    assert status == 200, body
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    for p, entry in enumerate(entries[1:]):
        token = str(prompt[p + 1])
        assert token in entry and entry[token]["logprob"] == pytest.approx(expected[p, prompt[p + 1]].item(), abs=1e-4)
        assert entry[token]["rank"] == 1 + int((expected[p] > expected[p, prompt[p + 1]]).sum())
        best = expected[p].topk(2).indices.tolist()
        assert all(str(t) in entry for t in best) and entry[str(best[0])]["rank"] == 1
        assert entry[token]["decoded_token"] == built.tokenizer.decode([prompt[p + 1]])
    assert body["choices"][0]["logprobs"] is None and not body["choices"][0]["text"].startswith("The")

    messages = [{"role": "user", "content": "hello"}]
    status, chat = post(port, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1,
                                                       "prompt_logprobs": 0})
    assert status == 200, chat
    ids = built.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    expected = _teacher_forced(built.model, list(ids))
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(ids)
    got = [entry[str(ids[p + 1])]["logprob"] for p, entry in enumerate(chat["prompt_logprobs"][1:])]
    assert got == pytest.approx([expected[p, ids[p + 1]].item() for p in range(len(ids) - 1)], abs=1e-4)


@pytest.mark.parametrize("route, extra, param", [
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs")])
def test_scoring_refusals_name_their_field(served, route, extra, param):
    where = {"prompt": "hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    status, body = post(served[0], route, {"model": MODEL, **where, **extra})
    assert status == 400 and body["error"]["param"] == param, body


def test_a_stream_carries_the_prompt_in_each_choices_first_chunk(served):
    """Streamed, the same numbers as the whole response: the echoed prompt, its logprobs and
    prompt_logprobs arrive in each choice's first chunk."""
    port = served[0]
    body = {**LM_EVAL_BODY, "max_tokens": 3, "prompt_logprobs": 1}
    whole = post(port, "/v1/completions", body)[1]
    status, events = stream_events(port, "/v1/completions", {**body, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert mine[0]["prompt_logprobs"] == choice["prompt_logprobs"]
        assert all("prompt_logprobs" not in c for c in mine[1:])
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for c in mine for x in c["logprobs"][key]] == choice["logprobs"][key], key


def test_a_greedy_continuation_is_greedy_bitwise(served):
    """The context, then the model's own greedy continuation: every continuation entry is the
    argmax, and lm-eval's exact float test ``token_logprob == max(top_logprobs)`` holds."""
    port, built = served
    prompt = list(LM_EVAL_BODY["prompt"][0])
    ctxlen = len(prompt)
    for _ in range(6):
        prompt.append(_teacher_forced(built.model, prompt + [0])[-1].argmax().item())
    status, body = post(port, "/v1/completions", {**LM_EVAL_BODY, "prompt": [prompt]})
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    assert all(lp["token_logprobs"][p] == max(lp["top_logprobs"][p].values()) for p in range(ctxlen, len(prompt)))
    assert _parse_like_lm_eval(body["choices"][0], ctxlen)[1] is True
    assert _parse_like_lm_eval(body["choices"][0], 1)[1] is False  # the context is not the model's argmax


def test_a_batch_of_token_lists_of_different_lengths_keeps_each_prompt_at_its_index(served):
    port, built = served
    first, second = LM_EVAL_BODY["prompt"]
    prompts = [first, second[:5], first[3:], second[:2]]
    status, body = post(port, "/v1/completions", {**LM_EVAL_BODY, "prompt": prompts, "max_tokens": 0})
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for prompt, choice in zip(prompts, body["choices"], strict=True):
        expected = _teacher_forced(built.model, prompt)
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
            [expected[p, prompt[p + 1]].item() for p in range(len(prompt) - 1)], abs=1e-4)
