"""What the load generator asks for: prompt and output lengths, streams and hang-ups, and the
longest request a launched server must accept.

Prompts are random token ids below ``max_token_id`` (any vocabulary serves them) and requests set
``ignore_eos``, so output lengths are exactly what the workload draws. Lengths are fixed (``N``)
or uniform over an inclusive range (``MIN:MAX``). Two datasets:

- ``random``: the prompt is ``prompt_len`` random ids;
- ``rag``: a long-context retrieval mix. There are ``rag_documents`` shared documents of
  ``rag_document_len`` random ids each (a retrieved context); a request is one of them, picked
  uniformly, followed by a short question of ``prompt_len`` fresh ids. Many questions on few
  long documents: the shape of RAG traffic, where prefix caching can reuse the document.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from functools import cached_property

from oscar_compile.bench.load_client import RequestRecord

DATASETS = ("random", "rag")
PAGE_SIZE = 16  # the shipped specs' KV page: max_model_len is rounded up to a multiple of it


@dataclass(frozen=True)
class Workload:
    """Lengths are drawn uniformly from the inclusive ranges (MIN == MAX: fixed); shares are probabilities."""

    prompt_len: tuple[int, int] = (64, 512)
    output_len: tuple[int, int] = (32, 256)
    stream_share: float = 0.5
    disconnect_share: float = 0.1  # of the streamed requests
    max_token_id: int = 1000
    temperature: float = 0.0
    dataset: str = "random"
    rag_documents: int = 4
    rag_document_len: int = 8192
    document_seed: int = 0  # the rag documents' ids (the warm-up uses other documents than the levels)

    def __post_init__(self) -> None:
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be N or MIN:MAX with 1 <= MIN <= MAX, got {lo}:{hi}")
        for name in ("stream_share", "disconnect_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.max_token_id < 2:
            raise ValueError(f"max_token_id must be >= 2, got {self.max_token_id}")
        if self.dataset == "rag" and not (self.rag_documents >= 1 and self.rag_document_len >= 1):
            raise ValueError("rag needs rag_documents >= 1 and rag_document_len >= 1, got "
                             f"{self.rag_documents} and {self.rag_document_len}")

    @cached_property
    def documents(self) -> list[list[int]]:
        """The rag documents (built once, on first use)."""
        rng = random.Random(f"rag-documents-{self.document_seed}")
        return [self._ids(rng, self.rag_document_len) for _ in range(self.rag_documents)]

    def _ids(self, rng: random.Random, n: int) -> list[int]:
        return rng.choices(range(1, self.max_token_id), k=n)

    def prompt(self, rng: random.Random) -> list[int]:
        question = self._ids(rng, rng.randint(*self.prompt_len))
        if self.dataset == "rag":
            return self.documents[rng.randrange(self.rag_documents)] + question
        return question

    def describe(self) -> str:
        def span(lo_hi: tuple[int, int]) -> str:
            return f"{lo_hi[0]}" if lo_hi[0] == lo_hi[1] else f"{lo_hi[0]}:{lo_hi[1]}"
        prompts = (f"rag: {self.rag_documents} documents of {self.rag_document_len} + questions of "
                   f"{span(self.prompt_len)}" if self.dataset == "rag" else f"prompts {span(self.prompt_len)}")
        return f"{prompts} tokens, outputs {span(self.output_len)}"

    def longest_prompt(self) -> int:
        return self.prompt_len[1] + (self.rag_document_len if self.dataset == "rag" else 0)

    def longest_request(self) -> int:
        """Prompt plus output tokens of the longest request the workload can draw."""
        return self.longest_prompt() + self.output_len[1]

    def warmup(self) -> Workload:
        """Whole responses of the shortest output, other rag documents than the levels'."""
        return replace(self, output_len=(self.output_len[0],) * 2, stream_share=0.0, disconnect_share=0.0,
                       document_seed=self.document_seed + 1)

    def draw(self, rng: random.Random, model: str) -> tuple[dict, RequestRecord, int | None]:
        """(body, an empty record, events before hanging up or None)."""
        prompt = self.prompt(rng)
        max_tokens = rng.randint(*self.output_len)
        stream = rng.random() < self.stream_share
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": self.temperature,
                "ignore_eos": True}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        hang_up = rng.randint(1, max(max_tokens - 1, 1)) if stream and rng.random() < self.disconnect_share else None
        return body, RequestRecord(stream, len(prompt), max_tokens), hang_up


def server_max_model_len(workload: Workload, page_size: int = PAGE_SIZE) -> int:
    """The context a launched server needs: the longest prompt plus the longest output, rounded up
    to a multiple of ``page_size`` (the server needs no more; whole pages keep the figure round).
    The server refuses (400) a prompt that leaves no room for one token and cuts a request's output
    at ``max_model_len``; a random-weight model's default (4096) refused every 8k prompt of issue
    39's run."""
    return -(-workload.longest_request() // page_size) * page_size


def parse_length(text: str) -> tuple[int, int]:
    """``N`` (fixed) or ``MIN:MAX`` (uniform)."""
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)
