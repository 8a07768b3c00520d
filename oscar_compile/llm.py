"""Offline batch generation: ``LLM(model_dir).generate(prompts, params)``, one ``RequestOutput`` per
prompt with its choices in ``.outputs``, the shapes of vLLM's ``LLM.generate``.

Runs the same engine as the server, synchronously, so offline results and served results agree.
It sits at the top of the package beside :func:`~oscar_compile.compress.compress` (as nano-vllm
keeps ``llm.py`` at the top): :func:`oscar_compile.assembly.assemble` puts together a loaded
model, the compression and the runtime, which know nothing of each other, as it does for the
server. ``oscar_compile.runtime.LLM`` stays the name users import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from oscar_compile.assembly import assemble
from oscar_compile.runtime.core.sampling_params import SamplingParams
from oscar_compile.runtime.core.token_logprob import TokenLogprob
from oscar_compile.runtime.engine import LLMEngine
from oscar_compile.runtime.engine_config import EngineConfig
from oscar_compile.runtime.output_processor import RequestOutput as StepOutput


@dataclass
class CompletionOutput:
    """One choice of a request: vLLM's fields, in vLLM's order, then ours.

    ``logprobs`` (one per token, the chosen token's logprob plus the k best) and
    ``cumulative_logprob`` (their sum) are None unless the request asked for ``logprobs``, as in
    vLLM: the engine computes a token's logprob only when asked."""

    index: int  # the choice, 0 to SamplingParams.n - 1
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    # the seed the tokens were drawn with: the request's, else its default (sampling_params.default_seed),
    # plus the choice's index
    seed: int | None = None
    # why this request failed alone (finish_reason "abort"): its structured-output constraint did not compile
    error: Exception | None = None


@dataclass
class RequestOutput:
    """One prompt's request: its ``n`` choices in ``outputs`` (vLLM's ``RequestOutput``).

    Not the engine's ``oscar_compile.runtime.output_processor.RequestOutput``, which is one step's
    delta of one choice; this one gathers those deltas into the finished request."""

    request_id: str
    prompt: str | None  # the prompt string; None when token ids were given (vLLM's)
    prompt_token_ids: list[int]
    # SamplingParams(prompt_logprobs=k): one per prompt token, the first None
    prompt_logprobs: list[TokenLogprob | None] | None
    outputs: list[CompletionOutput]
    finished: bool = False  # every choice has ended
    num_cached_tokens: int = 0  # prompt tokens the prefix cache gave (choice 0's, as the server's usage)


class LLM:
    """Generate from a model directory (or an already loaded model + tokenizer).

    With ``spec`` (a CompressionSpec or a YAML path) the model is rewritten by
    ``oscar_compile.apply`` with ``rotations`` (a Rotations or a .safetensors path; omitted, they
    are made without data, which only ``none`` / ``hadamard`` rotations allow) and served by the
    compressed runner over the paged cache. Without a spec the exact (uncached) RecomputeRunner
    runs the plain model. A compressed checkpoint (``oscar_compile.save_compressed``) brings its
    own spec and rotations: give neither. ``make_runner`` (a ``RunnerFactory``: the capabilities
    of the runner it builds, and ``build(page_manager)``) plugs in another runner.

    ``tensor_parallel_size=N`` splits the model over ``N`` processes, one per device (this one is
    rank 0 and runs the engine; ``oscar_compile.tensor_parallel``): it needs a plain model
    directory and a spec, and the ranks stop with ``close()`` (or at exit).

    ``deterministic=True`` (or ``EngineConfig(deterministic=True)``): a request's logprobs do not
    depend on the batch it shares, nor on the run (``oscar_compile.kernels.determinism``); what
    holds on which device and in which prefill semantics: README, "Deterministic mode".
    """

    def __init__(self, model: str | Path | torch.nn.Module | None = None, spec=None, rotations=None,
                 tokenizer=None, device: str = "auto", dtype: torch.dtype | None = None,
                 config: EngineConfig | None = None, make_runner=None, tensor_parallel_size: int = 1,
                 deterministic: bool = False):
        if deterministic:  # the same as EngineConfig(deterministic=True)
            config = dataclasses.replace(config or EngineConfig(), deterministic=True)
        built = assemble(model, spec, rotations, tokenizer=tokenizer, device=device, dtype=dtype, config=config,
                         make_runner=make_runner, tensor_parallel_size=tensor_parallel_size)
        self.model = built.model
        self.tokenizer = built.tokenizer
        self.engine: LLMEngine = built.engine
        self.tensor_parallel = built.tensor_parallel

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do on one device)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Prompts: a string, a list of token ids, or a list of either. One ``RequestOutput`` per
        prompt, in order, its ``n`` choices in ``outputs`` (``index`` 0 to n - 1; the prompt is
        prefilled once and choice ``i`` draws with seed + i, as vLLM's ``n``)."""
        prompts = _as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        all_ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        # the one validation (the engine's input processor): the batch is refused before any of it is queued
        accepted = [self.engine.input_processor.process(ids, p) for ids, p in zip(all_ids, params, strict=True)]
        requests: dict[str, RequestOutput] = {}
        for prompt, ids, p, accepted_request in zip(prompts, all_ids, params, accepted, strict=True):
            seq = self.engine.add(accepted_request)
            wants_logprobs = p.logprobs is not None
            choices = [CompletionOutput(index=i, seed=seq.seed + i, logprobs=[] if wants_logprobs else None,
                                        cumulative_logprob=0.0 if wants_logprobs else None) for i in range(p.n)]
            requests[seq.request_id] = RequestOutput(
                request_id=seq.request_id, prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=ids, prompt_logprobs=None, outputs=choices)
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                _add_delta(requests[delta.request_id], delta)
        return list(requests.values())  # in the order of the prompts


def _add_delta(request: RequestOutput, delta: StepOutput) -> None:
    """Fold one step's output of one choice into its request."""
    out = request.outputs[delta.index]
    out.token_ids += delta.new_token_ids
    out.text += delta.new_text
    if out.logprobs is not None:
        for lp in delta.new_logprobs:
            out.logprobs.append(lp)
            out.cumulative_logprob += lp.logprob
    if delta.index == 0:
        request.num_cached_tokens = delta.num_cached_prompt_tokens
    if delta.prompt_logprobs is not None:
        request.prompt_logprobs = delta.prompt_logprobs
    if delta.finished:
        out.finish_reason = delta.finish_reason
        out.error = delta.error
    request.finished = request.finished or delta.request_finished


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]
    if not all(isinstance(p, str) or (isinstance(p, (list, tuple))) for p in prompts):
        raise ValueError("prompts must be a string, a list of token ids, or a list of those")
    return prompts
