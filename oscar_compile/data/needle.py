"""Synthetic needle-in-a-haystack samples, shared by training and evaluation.

A sample is a haystack of real text (token ids taken from a corpus stream) with one
fact, "The special magic number for <key> is <value>.", inserted at a chosen depth,
optionally with distractor facts about other keys, followed by a question about
<key>. The prompt ends right before the value, so a model retrieves correctly when
its greedy continuation equals ``answer_ids``.

Why build token ids segment by segment instead of tokenizing one string: the value's
ids inside the needle and in ``answer_ids`` are then identical by construction, and
the prompt length is exact, so accuracy can be binned by context length and depth.
Everything is deterministic given ``seed``; only the tokenizer is needed (pure python;
the haystack may be a list, a numpy array or a memmap of token ids).

The prompts start with the model's own BOS token, as its tokenizer would put it in front of a
prompt: ``tokenizer.bos_token_id`` (``<|startoftext|>`` for the bundled model, ``<s>`` for
Llama and Mistral), or nothing when the tokenizer has none (most Qwen tokenizers). A caller that
knows the model's BOS better (the evaluation also reads the model config, as its perplexity
windows do) passes ``bos_id`` to :class:`TokenAdapter`.

Two layouts:
  * ``"plain"``:  BOS (if any), haystack, "Question: ... Answer: The special magic number for <key> is"
  * ``"chat"``:   the ChatML form the bundled tokenizer's chat template renders
    (BOS if any; user turn = haystack + question; assistant turn starts with the answer prefix), with
    ``messages`` for an OpenAI-style chat server (check ``answer in reply`` there).
"""
from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

ADJECTIVES = (
    "amber", "bold", "brisk", "calm", "crimson", "dusty", "eager", "faint", "fierce", "gentle",
    "golden", "hollow", "icy", "jolly", "keen", "lively", "lucky", "misty", "noble", "odd",
    "pale", "proud", "quiet", "rapid", "rusty", "shy", "silent", "silver", "sleepy", "sly",
    "stormy", "sunny", "swift", "tall", "tidy", "vivid", "wild", "wise", "young", "zesty",
)
NOUNS = (
    "badger", "beacon", "cactus", "canyon", "comet", "falcon", "ferret", "fjord", "garden", "glacier",
    "harbor", "heron", "island", "jaguar", "kettle", "lantern", "meadow", "meteor", "orchid", "otter",
    "panther", "pebble", "pepper", "pirate", "quartz", "raven", "river", "rocket", "saddle", "salmon",
    "spider", "summit", "tiger", "tulip", "turtle", "valley", "walrus", "willow", "wizard", "zebra",
)

NEEDLE_PREFIX = "\nThe special magic number for {key} is"
NEEDLE_SUFFIX = ".\n"
PLAIN_QUESTION = ("\n\nQuestion: What is the special magic number for {key}?\n"
                  "Answer: The special magic number for {key} is")
CHAT_QUESTION = "\n\nWhat is the special magic number for {key}?"
CHAT_ANSWER_PREFIX = "The special magic number for {key} is"
BOS, EOS, IM_START, IM_END = "<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"


@dataclass(frozen=True)
class NeedleSample:
    """One needle prompt. ``input_ids`` has exactly ``length`` ids, the BOS first when there is one."""

    input_ids: list[int]
    answer_ids: list[int]        # greedy continuation that counts as correct
    completion_ids: list[int]    # answer_ids + end of the reply (training target tail)
    answer: str                  # the value as text, e.g. "583920"
    key: str
    depth: float                 # share of haystack tokens before the needle, 0..1
    needle_pos: int              # index in input_ids where the needle sentence starts
    length: int
    fmt: str
    prompt_text: str             # decode(input_ids) without the BOS
    messages: list[dict[str, str]] | None = field(default=None)


TOKENIZER_BOS: Any = object()  # "the tokenizer's own BOS": the default of every bos_id argument


class TokenAdapter:
    """Adapter over a transformers tokenizer or a raw ``tokenizers.Tokenizer``.

    ``bos`` is the id the prompts start with, or None for none: ``bos_id`` when given (an int or
    None), else the tokenizer's ``bos_token_id``. A raw ``tokenizers.Tokenizer`` names no BOS, so
    it gets ``<|startoftext|>`` when its vocabulary has that token (the bundled convention).
    ``eos`` likewise: the tokenizer's ``eos_token_id``, for a raw one ``<|endoftext|>``.
    """

    def __init__(self, tokenizer: Any, bos_id: Any = TOKENIZER_BOS):
        self.t = tokenizer
        self.raw = not hasattr(tokenizer, "convert_tokens_to_ids")
        if bos_id is not TOKENIZER_BOS:
            self.bos = None if bos_id is None else int(bos_id)
        else:
            self.bos = self.token_id(BOS) if self.raw else _as_id(getattr(tokenizer, "bos_token_id", None))
        self.eos = self.token_id(EOS) if self.raw else _as_id(getattr(tokenizer, "eos_token_id", None))
        self.im_start, self.im_end = self.token_id(IM_START), self.token_id(IM_END)
        special = [self.bos, self.eos, self.im_start, self.im_end]
        special += [] if self.raw else list(getattr(tokenizer, "all_special_ids", []))
        self.special = {int(i) for i in special if i is not None}
        self.newline = self.encode("\n")[0]

    @property
    def head(self) -> list[int]:
        """What a prompt starts with: ``[bos]``, or nothing when the model has no BOS."""
        return [] if self.bos is None else [self.bos]

    def token_id(self, tok: str) -> int | None:
        i = self.t.token_to_id(tok) if self.raw else self.t.convert_tokens_to_ids(tok)
        return None if i is None or (not self.raw and i == getattr(self.t, "unk_token_id", -1)) else int(i)

    def encode(self, text: str) -> list[int]:
        if self.raw:
            return list(self.t.encode(text, add_special_tokens=False).ids)
        return list(self.t.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.t.decode(list(ids), skip_special_tokens=False)


def _as_id(value: Any) -> int | None:
    return None if value is None else int(value)


def _random_key(rng: random.Random, exclude: set[str]) -> str:
    while True:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in exclude:
            return key


def make_needle_sample(tokenizer: Any, haystack: Sequence[int], length: int, *,
                       depth: float | None = None, seed: int = 0, fmt: str = "plain",
                       n_distractors: int = 0, with_text: bool = True,
                       tok: TokenAdapter | None = None) -> NeedleSample:
    """Build one sample of exactly ``length`` prompt tokens.

    ``depth`` (0..1, None = uniform random) places the needle within the haystack;
    distractors (other keys, other values) go to independent random depths. Special
    tokens inside the haystack slice (document separators) become newlines so the
    haystack decodes to clean text for a chat server. ``with_text=False`` skips the
    decoding of ``prompt_text``/``messages`` (training only needs ids).
    """
    if fmt not in ("plain", "chat"):
        raise ValueError(f"fmt must be 'plain' or 'chat', not {fmt!r}")
    tk = tok or TokenAdapter(tokenizer)
    rng = random.Random(seed)
    key = _random_key(rng, set())
    value = str(rng.randrange(100000, 1000000))
    others = []
    for _ in range(n_distractors):
        other_key = _random_key(rng, {key} | {k for k, _ in others})
        others.append((other_key, str(rng.randrange(100000, 1000000))))

    def needle(k: str, v: str) -> tuple[list[int], list[int]]:
        v_ids = tk.encode(" " + v)
        return tk.encode(NEEDLE_PREFIX.format(key=k)) + v_ids + tk.encode(NEEDLE_SUFFIX), v_ids

    needle_ids, answer_ids = needle(key, value)
    distractor_ids = [needle(k, v)[0] for k, v in others]
    if fmt == "plain":
        head = tk.head
        tail = tk.encode(PLAIN_QUESTION.format(key=key))
        end = tk.encode(NEEDLE_SUFFIX) + ([] if tk.eos is None else [tk.eos])
    else:
        if tk.im_start is None or tk.im_end is None:
            raise ValueError("tokenizer lacks <|im_start|>/<|im_end|> for the chat layout")
        head = tk.head + [tk.im_start] + tk.encode("user\n")
        question_ids = tk.encode(CHAT_QUESTION.format(key=key))
        tail = (question_ids + [tk.im_end] + tk.encode("\n") + [tk.im_start]
                + tk.encode("assistant\n") + tk.encode(CHAT_ANSWER_PREFIX.format(key=key)))
        end = tk.encode(".") + [tk.im_end] + tk.encode("\n") + ([] if tk.eos is None else [tk.eos])
    fixed = len(head) + len(tail) + len(needle_ids) + sum(map(len, distractor_ids))
    n_fill = length - fixed
    if n_fill < 0:
        raise ValueError(f"length {length} too short for this needle layout (needs {fixed})")
    if len(haystack) < n_fill:
        raise ValueError("haystack shorter than the filler needed")
    start = rng.randrange(0, len(haystack) - n_fill + 1)
    filler = [tk.newline if int(t) in tk.special else int(t) for t in haystack[start:start + n_fill]]

    # Insertion points: distractors first at random depths, then the needle at `depth`.
    d = rng.random() if depth is None else min(max(float(depth), 0.0), 1.0)
    pos = round(d * n_fill)
    inserts = [(round(rng.random() * n_fill), ids, False) for ids in distractor_ids]
    inserts.append((pos, needle_ids, True))
    inserts.sort(key=lambda x: (x[0], x[2]))
    body: list[int] = []
    needle_offset, prev = 0, 0
    for p, ids, is_needle in inserts:
        body += filler[prev:p]
        prev = p
        if is_needle:
            needle_offset = len(body)
        body += ids
    body += filler[prev:]

    input_ids = head + body + tail
    assert len(input_ids) == length
    messages = None
    if fmt == "chat" and with_text:
        content = tk.decode(body) + CHAT_QUESTION.format(key=key)
        messages = [{"role": "user", "content": content}]
    return NeedleSample(
        input_ids=input_ids, answer_ids=answer_ids, completion_ids=answer_ids + end,
        answer=value, key=key, depth=pos / n_fill if n_fill else 0.0,
        needle_pos=len(head) + needle_offset, length=length, fmt=fmt,
        prompt_text=tk.decode(input_ids[len(tk.head):]) if with_text else "", messages=messages)


def needle_grid(tokenizer: Any, haystack: Sequence[int], lengths: Sequence[int],
                depths: Sequence[float], n_per_cell: int, *, seed: int = 0, fmt: str = "plain",
                n_distractors: int = 0, bos_id: Any = TOKENIZER_BOS) -> Iterator[NeedleSample]:
    """Yield ``n_per_cell`` samples for every (length, depth) cell, each with its own seed.

    ``bos_id``: the id the prompts start with (None: no BOS); default the tokenizer's (TokenAdapter).
    """
    tk = TokenAdapter(tokenizer, bos_id)
    for li, length in enumerate(lengths):
        for di, depth in enumerate(depths):
            for k in range(n_per_cell):
                s = (seed * 1_000_003 + li * 10_007 + di * 101 + k) & 0x7FFFFFFF
                yield make_needle_sample(tokenizer, haystack, length, depth=depth, seed=s,
                                         fmt=fmt, n_distractors=n_distractors, tok=tk)
