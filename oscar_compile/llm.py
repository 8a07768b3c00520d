"""Offline batch generation: ``LLM(model_dir).generate(prompts, params)``.

Runs the same engine as the server, synchronously, so offline results and served results agree.
It sits at the top of the package beside :func:`~oscar_compile.compress.compress` (as nano-vllm
keeps ``llm.py`` at the top): it assembles a loaded model, the compression and the runtime, which
know nothing of each other. ``oscar_compile.runtime.LLM`` stays the name users import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from oscar_compile.checkpoint import compression_of
from oscar_compile.compress import compress
from oscar_compile.loading import load_model, resolve_device, resolve_model_dir
from oscar_compile.runtime.engine import LLMEngine, TokenLogprob
from oscar_compile.runtime.loader import EngineConfig, build_engine
from oscar_compile.runtime.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0


class LLM:
    """Generate from a model directory (or an already loaded model + tokenizer).

    With ``spec`` (a CompressionSpec or a YAML path) the model is rewritten by
    ``oscar_compile.apply`` with ``rotations`` (a Rotations or a .safetensors path; omitted, they
    are made without data, which only ``none`` / ``hadamard`` rotations allow) and served by the
    compressed runner over the paged cache. Without a spec the exact (uncached) RecomputeRunner
    runs the plain model. A compressed checkpoint (``oscar_compile.save_compressed``) brings its
    own spec and rotations: give neither. ``make_runner(block_manager)`` plugs in another runner.

    ``tensor_parallel_size=N`` splits the model over ``N`` processes, one per device (this one is
    rank 0 and runs the engine; ``oscar_compile.tensor_parallel``): it needs a plain model
    directory and a spec, and the ranks stop with ``close()`` (or at exit).
    """

    def __init__(self, model: str | Path | torch.nn.Module | None = None, spec=None, rotations=None,
                 tokenizer=None, device: str = "auto", dtype: torch.dtype | None = None,
                 config: EngineConfig | None = None, make_runner=None, tensor_parallel_size: int = 1):
        if rotations is not None and spec is None:
            raise ValueError("rotations were given without the spec they are applied with")
        self.tensor_parallel = None
        if tensor_parallel_size != 1:
            self._start_tensor_parallel(model, spec, rotations, tokenizer, device, dtype, config, make_runner,
                                        tensor_parallel_size)
            return
        values_folded = False
        if isinstance(model, torch.nn.Module):
            if tokenizer is None:
                raise ValueError("tokenizer is required when model is an nn.Module")
        else:
            model_dir = resolve_model_dir(model)
            compression = compression_of(model_dir)
            if compression is not None:
                if spec is not None or rotations is not None:
                    raise ValueError(f"{model_dir} is a compressed checkpoint: it brings its own spec and rotations "
                                     "(give neither)")
                spec, values_folded = compression.spec, True
            model, loaded_tokenizer = load_model(model_dir, resolve_device(device), dtype)
            tokenizer = tokenizer or loaded_tokenizer
            if compression is not None:
                rotations = compression.load_rotations(model)
        if spec is not None:
            config, make_runner = compress(model, spec, rotations, config, values_folded=values_folded)
        self.model = model
        self.tokenizer = tokenizer
        self.engine: LLMEngine = build_engine(model, tokenizer, config, make_runner=make_runner)

    def _start_tensor_parallel(self, model, spec, rotations, tokenizer, device, dtype, config, make_runner,
                               world_size: int) -> None:
        from oscar_compile.tensor_parallel import launch

        if isinstance(model, torch.nn.Module) or make_runner is not None:
            raise ValueError("tensor_parallel_size > 1 loads the model in every rank: pass a model directory "
                             "(not a loaded model or a make_runner)")
        model_dir = resolve_model_dir(model)
        if compression_of(model_dir) is not None:
            raise ValueError(f"{model_dir} is a compressed checkpoint, whose value rotations are already folded "
                             "into the weights; tensor_parallel_size > 1 splits a plain model: pass the source "
                             "model with its spec and rotations")
        if spec is None:
            raise ValueError("tensor_parallel_size > 1 serves through the paged runtime: pass a spec "
                             "(specs/bf16.yaml for no compression)")
        self.tensor_parallel, self.model, self.tokenizer, self.engine = launch.start_engine(
            model_dir, spec, rotations, config, world_size, resolve_device(device), dtype, tokenizer)

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do on one device)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[CompletionOutput]:
        """Prompts: a string, a list of token ids, or a list of either. One output per prompt."""
        prompts = _as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        all_ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for ids, p in zip(all_ids, params, strict=True):  # refuse the batch before queueing any of it
            self.engine.validate_request(ids, p)
        outputs: dict[str, CompletionOutput] = {}
        order = []
        for ids, p in zip(all_ids, params, strict=True):
            seq = self.engine.add_request(ids, p)
            outputs[seq.request_id] = CompletionOutput(prompt_token_ids=ids)
            order.append(seq.request_id)
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                out = outputs[delta.request_id]
                out.token_ids += delta.new_token_ids
                out.text += delta.new_text
                out.logprobs += delta.new_logprobs
                out.num_cached_prompt_tokens = delta.num_cached_prompt_tokens
                if delta.finished:
                    out.finish_reason = delta.finish_reason
        return [outputs[request_id] for request_id in order]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]
    if not all(isinstance(p, str) or (isinstance(p, (list, tuple))) for p in prompts):
        raise ValueError("prompts must be a string, a list of token ids, or a list of those")
    return prompts
