"""From sampled tokens to what a request gains: detokenizing, stop checks, ``RequestOutput``s.

vLLM v1's ``OutputProcessor``: the engine appends the tokens a step drew; this module decides
whether a sequence stops there (an EOS or stop token id, a stop string in the detokenized text,
a grammar that terminated, the length limits) and builds the delta each choice hands out. It
holds no tensors and runs on the engine's thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from oscar_compile.runtime.core.sequence import FinishReason, Sequence
from oscar_compile.runtime.core.token_logprob import TokenLogprob
from oscar_compile.runtime.detokenizer import IncrementalDetokenizer
from oscar_compile.runtime.structured_output import StructuredOutputManager


@dataclass
class RequestOutput:
    """What one request gained in one step (``new_*``) plus its running totals."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_prompt_tokens: int
    # with the first output of a request that asked for them: one per prompt token, the first None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0  # the choice (SamplingParams.n); ``finished`` is this choice's
    request_finished: bool = False  # every choice of the request has ended
    error: Exception | None = None  # why the request failed alone (a grammar that did not compile)


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: frozenset[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def add(self, seq: Sequence) -> None:
        """Give a new sequence (or a forked choice) its detokenizer."""
        seq.detokenizer = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, seq.params.stop, seq.params.skip_special_tokens)

    def append(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None,
               structured: StructuredOutputManager | None) -> FinishReason | None:
        """Append a drawn token (and its logprob) to ``seq``; why it stops there, or None."""
        seq.append_token(token_id)
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        params = seq.params
        if (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            return FinishReason.STOP  # the stop token's text is not part of the output
        if seq.detokenizer.append(token_id):
            return FinishReason.STOP
        if structured is not None and structured.is_terminated(seq):
            return FinishReason.STOP  # the grammar is complete (its stop token is not EOS here)
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def finish(seq: Sequence) -> None:
        """The text held back for stop strings is final now."""
        seq.detokenizer.flush()

    @staticmethod
    def output(seq: Sequence, new_ids: list[int], new_logprobs: list[TokenLogprob], finished: bool,
               request_finished: bool = False, prompt_logprobs: list[TokenLogprob | None] | None = None
               ) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new_ids,
            new_text=seq.detokenizer.take_delta(finished), new_logprobs=new_logprobs,
            finished=finished, finish_reason=seq.finish_reason.value if finished else None,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            num_cached_prompt_tokens=seq.num_cached_prompt_tokens, prompt_logprobs=prompt_logprobs,
            index=seq.choice_index, request_finished=request_finished)
