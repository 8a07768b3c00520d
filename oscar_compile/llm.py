"""Offline batch generation: ``LLM(model_dir).generate(prompts, params)``.

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
from oscar_compile.runtime.engine import LLMEngine, TokenLogprob
from oscar_compile.runtime.engine_config import EngineConfig


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0
    # SamplingParams(prompt_logprobs=k): one per prompt token, the first None (vLLM's field)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # the seed the tokens were drawn with: the request's, else its default (sampling_params.default_seed),
    # plus the choice's index
    seed: int | None = None
    index: int = 0  # the choice, with SamplingParams.n > 1
    # why this request failed alone (finish_reason "abort"): its structured-output constraint did not compile
    error: Exception | None = None


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
                 ) -> list[CompletionOutput]:
        """Prompts: a string, a list of token ids, or a list of either. One output per prompt, or
        with ``n`` > 1 its ``n`` choices in a row (``index`` 0 to n - 1; the prompt is prefilled
        once and choice ``i`` draws with seed + i, as vLLM's ``n``)."""
        prompts = _as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        all_ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        # the one validation (the engine's input processor): the batch is refused before any of it is queued
        requests = [self.engine.input_processor.process(ids, p) for ids, p in zip(all_ids, params, strict=True)]
        outputs: dict[tuple[str, int], CompletionOutput] = {}
        for ids, p, request in zip(all_ids, params, requests, strict=True):
            seq = self.engine.add(request)
            for i in range(p.n):
                outputs[seq.request_id, i] = CompletionOutput(prompt_token_ids=ids, seed=seq.seed + i, index=i)
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                out = outputs[delta.request_id, delta.index]
                out.token_ids += delta.new_token_ids
                out.text += delta.new_text
                out.logprobs += delta.new_logprobs
                out.num_cached_prompt_tokens = delta.num_cached_prompt_tokens
                if delta.prompt_logprobs is not None:
                    out.prompt_logprobs = delta.prompt_logprobs
                if delta.finished:
                    out.finish_reason = delta.finish_reason
                    out.error = delta.error
        return list(outputs.values())  # in insertion order: prompt by prompt, choice by choice


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]
    if not all(isinstance(p, str) or (isinstance(p, (list, tuple))) for p in prompts):
        raise ValueError("prompts must be a string, a list of token ids, or a list of those")
    return prompts
