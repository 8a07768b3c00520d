"""One validation, at the front, into a request the engine trusts (vLLM v1's ``Processor`` and
``EngineCoreRequest``).

``InputProcessor.process`` checks a prompt and its ``SamplingParams`` against what this engine
can run (its vocabulary, context length, batch limits, pages and runner capabilities) and returns
an ``EngineRequest``; ``LLMEngine.add`` and ``AsyncEngine.submit`` take only that and check
nothing again. The offline ``LLM.generate``, ``LLMEngine.add_request`` and the server
(``server/requests.py``) all come through here. The checks run in three stages, each once: the
prompt alone (``check_prompt``: the server answers for the field the prompt came in, and needs a
valid prompt before it sizes ``max_tokens`` from the room left), the parameters alone
(``check_params``), then the two together (``make_request``: whether the request fits the pages).

It reads only settings fixed when the engine was built, so any thread may call it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from oscar_compile.runtime.core.config import RunnerCapabilities
from oscar_compile.runtime.core.page_manager import PageManager
from oscar_compile.runtime.core.sampling_params import RequestError, SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """A validated request: what crosses from the front (a handler, ``LLM.generate``) to the
    engine thread. ``request_id`` None: the engine names it after its sequence (and a request
    without a seed gets its default seed from that name when it is added, as before)."""

    request_id: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic()


class InputProcessor:
    def __init__(self, vocab_size: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 page_manager: PageManager, capabilities: RunnerCapabilities):
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._pages = page_manager  # read for its fixed sizes only
        self.capabilities = capabilities

    def process(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                request_id: str | None = None, arrival_time: float | None = None,
                prompt_param: str = "prompt") -> EngineRequest:
        """Every check, in order; RequestError naming the field at fault (a prompt's problems
        name ``prompt_param``). ``arrival_time``: ``time.monotonic()`` (default: now)."""
        params = params if params is not None else SamplingParams()
        self.check_prompt(prompt_token_ids, prompt_param)
        self.check_params(params)
        return self.make_request(prompt_token_ids, params, request_id, arrival_time)

    def check_prompt(self, prompt_token_ids: list[int], param: str = "prompt") -> None:
        """Token ids in the vocabulary, and room for at least one token after the prompt."""
        num_prompt = len(prompt_token_ids)
        if num_prompt < 1:
            raise RequestError(param, "prompt must hold at least one token")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestError(param, f"prompt token ids must be integers in [0, {vocab})")
        if num_prompt + 1 > self.max_model_len:
            raise RequestError(param, f"this model's maximum context length is {self.max_model_len} tokens, "
                               f"the prompt has {num_prompt} (plus at least 1 to generate)",
                               code="context_length_exceeded")
        if (num_prompt > self.max_num_batched_tokens and self._pages.staging_pool.num_pages
                and not self._pages.can_ever_stage(num_prompt)):
            raise RequestError(param, f"a prompt of {num_prompt} tokens is prefilled in chunks, and its history does "
                               "not fit the prefill staging memory: raise --prefill-staging-memory (or "
                               "--max-num-batched-tokens)", code="context_length_exceeded")
        if not self._pages.can_ever_fit(num_prompt + 1, 1, num_prompt):
            raise RequestError(param, f"{num_prompt + 1} tokens do not fit the KV cache pages even for one request "
                               "alone", code="context_length_exceeded")

    def check_params(self, params: SamplingParams) -> None:
        """What this engine cannot do, or token ids outside its vocabulary."""
        vocab = self.vocab_size
        if params.prompt_logprobs is not None and not self.capabilities.prompt_logits:
            raise RequestError("prompt_logprobs", "this engine's runner cannot return prompt logprobs")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise RequestError("stop_token_ids", f"stop_token_ids must be token ids in [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise RequestError("logit_bias", f"logit_bias token ids must be in [0, {vocab})")
        if params.n > 1 and not self.capabilities.page_copies:
            raise RequestError("n", "this engine's runner cannot fork choices: n must be 1")
        if params.n > self.max_num_seqs:
            raise RequestError("n", f"n = {params.n} choices exceed this server's {self.max_num_seqs} "
                               "sequences at once (--max-num-seqs)")

    def make_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                     arrival_time: float | None = None) -> EngineRequest:
        """The request, once its prompt and params passed their checks: whether they fit together."""
        num_prompt = len(prompt_token_ids)
        num_tokens = min(num_prompt + params.max_tokens, self.max_model_len)
        if not self._pages.can_ever_fit(num_tokens, params.n, num_prompt):
            choices = f" in each of {params.n} choices" if params.n > 1 else ""
            raise RequestError("max_tokens", f"{num_tokens} tokens{choices} do not fit the KV cache pages even for "
                               "one request alone", code="context_length_exceeded")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        return EngineRequest(request_id, list(prompt_token_ids), params, arrival)

    def max_new_tokens(self, num_prompt_tokens: int, num_choices: int = 1) -> int:
        """The most tokens a prompt of this length may generate in each of ``num_choices``
        choices (context and pages)."""
        limit = min(self.max_model_len, self._pages.max_seq_len(num_choices, num_prompt_tokens))
        return max(limit - num_prompt_tokens, 0)
