"""The workload's length distributions (fixed, uniform, the RAG mix) and the context a launched
server is told, from the workload's longest request."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from oscar_compile.bench.load_datasets import Workload, parse_length, server_max_model_len
from oscar_compile.bench.load_server import launch_args, mode_args


def _draws(workload: Workload, n: int = 300):
    rng = random.Random(0)
    return [workload.draw(rng, "m") for _ in range(n)]


def test_fixed_lengths():
    for body, record, _ in _draws(Workload(prompt_len=parse_length("37"), output_len=parse_length("5"))):
        assert len(body["prompt"]) == record.num_prompt_tokens == 37 and body["max_tokens"] == 5


def test_uniform_lengths_cover_their_whole_range_and_nothing_else():
    draws = _draws(Workload(prompt_len=parse_length("3:9"), output_len=parse_length("2:4"), max_token_id=7))
    assert {len(body["prompt"]) for body, _, _ in draws} == set(range(3, 10))
    assert {body["max_tokens"] for body, _, _ in draws} == {2, 3, 4}
    assert all(1 <= t < 7 for body, _, _ in draws for t in body["prompt"])


def test_rag_prompts_are_a_shared_document_then_a_short_question():
    workload = Workload(prompt_len=(4, 8), output_len=(3, 3), dataset="rag", rag_documents=3, rag_document_len=50)
    docs = workload.documents
    assert len(docs) == 3 and all(len(d) == 50 for d in docs) and len({tuple(d) for d in docs}) == 3
    seen = set()
    for body, record, _ in _draws(workload):
        prompt = body["prompt"]
        assert 54 <= len(prompt) <= 58 == workload.longest_prompt() and record.num_prompt_tokens == len(prompt)
        seen.add(docs.index(prompt[:50]))
    assert seen == {0, 1, 2}
    assert not {tuple(d) for d in workload.warmup().documents} & {tuple(d) for d in docs}  # warm-up: other docs


def test_bad_workloads_are_refused():
    for bad in (dict(prompt_len=(5, 3)), dict(output_len=(0, 3)), dict(stream_share=1.5), dict(dataset="sharegpt"),
                dict(dataset="rag", rag_documents=0)):
        with pytest.raises(ValueError):
            Workload(**bad)


def test_the_launched_server_is_told_the_longest_request():
    assert server_max_model_len(Workload(prompt_len=(1000, 8000), output_len=(64, 512))) == 8512
    assert server_max_model_len(Workload(prompt_len=(10, 1000), output_len=(5, 100))) == 1104  # whole pages of 16
    rag = Workload(prompt_len=(32, 128), output_len=(64, 512), dataset="rag", rag_document_len=8192)
    assert server_max_model_len(rag) == 8832
    assert launch_args("random:8b", "bf16", ["--kv-memory", "50"], 8512) == [
        "--mode", "bf16", "--max-model-len", "8512", "--kv-memory", "50"]
    assert launch_args("random:8b", None, [], 8512) == ["--max-model-len", "8512"]
    # the user's own --max-model-len wins
    assert launch_args("random:8b", "int2", ["--max-model-len", "300"], 8512) == ["--mode", "int2", "--max-model-len",
                                                                                 "300"]
    assert launch_args("bundled", None, ["--max-model-len=300"], 8512) == ["--max-model-len=300"]


def test_modes_of_every_launch_kind(tmp_path):
    assert mode_args("bundled", "int2")[1].endswith("oscar-int2.yaml")
    assert mode_args(str(tmp_path), "int2")[1].endswith("hadamard-int2.yaml")
    for launch in ("bundled", str(tmp_path)):
        flag, spec = mode_args(launch, "bf16")
        assert flag == "--spec" and spec.endswith("bf16.yaml")
        assert all(p.endswith(".yaml") and Path(p).is_file()
                   for p in (spec, mode_args(launch, "int2")[1]))
    with pytest.raises(ValueError, match="--modes takes"):
        mode_args("bundled", "int4")


def test_workload_description():
    assert Workload((64, 512), (32, 32)).describe() == "prompts 64:512 tokens, outputs 32"
    assert Workload((32, 128), (64, 512), dataset="rag", rag_documents=4, rag_document_len=8192).describe() == \
        "rag: 4 documents of 8192 + questions of 32:128 tokens, outputs 64:512"
