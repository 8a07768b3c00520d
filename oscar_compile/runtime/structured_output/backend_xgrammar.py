"""The xgrammar backend (the engine picked by bench/results/2026-12-03-cpu-structured-output-engines).

JSON is compiled compact: separators ``,`` and ``:`` and no free whitespace
(``any_whitespace=False``): a small model cannot wander off into endless blanks, and the output
is the fewest tokens. ``json_object`` is the schema ``{"type": "object"}`` under the same rule.
Schemas compile in xgrammar's strict mode (vLLM's default): properties a schema does not name are
refused unless it sets ``additionalProperties``. ``choice`` is a grammar of string alternatives;
``grammar`` is xgrammar's EBNF (GBNF: ``root ::= ...``), as vLLM's xgrammar backend takes it.
"""

from __future__ import annotations

import json
import os

import torch

from oscar_compile.runtime.core.sampling_params import StructuredOutputParams
from oscar_compile.runtime.structured_output.backend import Grammar, StructuredOutputBackend

JSON_SEPARATORS = (",", ":")
# Below this many rows a step's bitmask is filled on one thread: xgrammar's thread pool costs more
# per call than it saves. On the H200 host (16 cores) its "auto" pool (8 threads) took 5.35 ms per
# step for 32 rows, where one thread takes ~1.2 ms (bench/results/2026-12-03-h200-gpu-tests-structured-deterministic);
# vLLM fills in parallel from 128 rows on, as here.
PARALLEL_FILL_ROWS = 128


class XgrammarGrammar(Grammar):
    def __init__(self, matcher):
        self.matcher = matcher
        self._refused = False

    def accept(self, token_id: int) -> bool:
        if not self.matcher.accept_token(token_id):
            self._refused = True
        return not self._refused

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        return self._refused or self.matcher.is_terminated()


class XgrammarBackend(StructuredOutputBackend):
    """``tokenizer``: a transformers tokenizer; ``stop_token_ids``: the engine's EOS ids (what
    ends a completed grammar), else the tokenizer's."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None, max_threads: int = 2):
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) if stop_token_ids else None
        )
        # the manager caches by StructuredOutputParams.key: xgrammar's own cache would hold a second copy
        # (a GrammarCompiler may compile from several threads at once, as vLLM's pool does)
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._serial = xgr.BatchGrammarMatcher(1)  # one C++ call per step, no Python loop over rows
        self._parallel = xgr.BatchGrammarMatcher(max(1, min(8, (os.cpu_count() or 2) // 2)))

    def compile(self, params: StructuredOutputParams):
        compiler = self._compiler
        if params.kind in ("json", "json_object"):
            schema = {"type": "object"} if params.json_object else params.json
            text = schema if isinstance(schema, str) else json.dumps(schema)
            return compiler.compile_json_schema(text, any_whitespace=False, separators=JSON_SEPARATORS)
        if params.kind == "regex":
            return compiler.compile_regex(params.regex)
        if params.kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        return compiler.compile_grammar(params.grammar)

    def new_grammar(self, compiled) -> Grammar:
        return XgrammarGrammar(self._xgr.GrammarMatcher(compiled))

    def fill_bitmask(self, grammars: list[Grammar], bitmask: torch.Tensor, rows: list[int]) -> None:
        """The fill hides behind the forward only while it is shorter: a row costs ~40 µs on
        average with a 151,936-token vocabulary, far more inside a JSON string than between fields
        (bench/results/2026-12-03-cpu-structured-output-engines); threads from ``PARALLEL_FILL_ROWS`` rows."""
        if len(grammars) < 2:
            return super().fill_bitmask(grammars, bitmask, rows)
        batch = self._parallel if len(grammars) >= PARALLEL_FILL_ROWS else self._serial
        batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask, rows)
