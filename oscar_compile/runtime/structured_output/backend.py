"""The interface between the engine and a grammar engine (xgrammar, llguidance, ...).

A backend compiles a ``StructuredOutputParams`` into an opaque compiled grammar (thread-safe, so
the manager can compile on a pool; the compiled object is shared by every request of that
constraint) and makes a fresh ``Grammar`` (one request's parser state) from it. A ``Grammar``
advances by accepted tokens, writes the tokens it allows next as one row of a token bitmask and
knows when it has terminated.

The bitmask is xgrammar's and llguidance's layout, also vLLM's: int32 ``[B, ceil(V / 32)]``,
token ``v`` allowed iff bit ``v % 32`` of word ``v // 32`` of its row is set (``-1`` allows all).
The worker applies it (``worker/grammar_mask.py``).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any

import torch

from oscar_compile.runtime.core.sampling_params import RequestError, StructuredOutputParams

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ", re.MULTILINE)


class GrammarEngineUnavailable(RuntimeError):
    """The grammar engine is not installed where the server runs: the server's fault, not the
    request's, so the server answers 501 rather than a 400. Never cached: a request after
    ``pip install`` compiles again."""


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def error_param(params: StructuredOutputParams) -> str:
    """The request field a compile error names: the one that holds the constraint's value."""
    if params.value_param is not None:
        return params.value_param
    return params.param if params.json_object else f"{params.param}.{params.kind}"


def compile_error(params: StructuredOutputParams, err: Exception) -> RequestError:
    what = {"json": "JSON schema", "json_object": "JSON object constraint"}.get(params.kind, params.kind)
    # engines prefix their C++ log location ("[10:52:08] /project/cpp/x.cc:94: "): not the client's business
    message = _LOG_PREFIX.sub("", str(err)).strip()
    return RequestError(error_param(params), f"invalid {what}: {message}", code="invalid_structured_output")


class Grammar(ABC):
    """One request's parser state. Used by the engine thread only."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar refuses it (the state is then
        terminated, so the request stops)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32, on the CPU)."""

    @property
    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar took its stop token (or refused one): nothing may follow."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer and vocabulary size (the model's logit width,
    which may exceed the tokenizer's: the extra ids are never allowed)."""

    @abstractmethod
    def compile(self, params: StructuredOutputParams) -> Any:
        """The compiled grammar; raises the engine's own exception for a bad constraint (the
        manager names the request's field: ``compile_error``). Called from pool threads."""

    @abstractmethod
    def new_grammar(self, compiled: Any) -> Grammar: ...

    def fill_bitmask(self, grammars: list[Grammar], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill ``bitmask[rows[i]]`` from ``grammars[i]`` (this backend's); an engine may spread
        the rows over threads."""
        for grammar, row in zip(grammars, rows, strict=True):
            grammar.fill_bitmask(bitmask, row)
