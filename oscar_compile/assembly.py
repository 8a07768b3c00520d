"""A model, its compression and the runtime assembled into an engine: ``LLM`` and the server call this.

``assemble`` takes a model directory (or a loaded model and its tokenizer), a spec and rotations,
and returns the engine that serves them: it reads a compressed checkpoint's own spec and
rotations, fits the spec to the model once (from ``config.json``, before any weight is loaded),
loads the model, rewrites it (``compress``) and builds the engine, or starts the ranks of a
tensor-parallel split. ``build_app`` is the one factory of the OpenAI server over an assembly
(the serve command, the random-model bench and any other server call it); ``assemble_for_serving``
assembles with the serve command's defaults (``default_compression``).

It sits at the top of the package beside ``compress`` and ``LLM``: it reaches into the
checkpoint, the passes, tensor parallelism and the runtime, which know nothing of each other.
``oscar_compile.cli.serve`` (``oscar-compile serve`` and ``python -m oscar_compile.runtime.serve``)
parses flags and calls ``assemble_for_serving`` and ``build_app``; ``oscar_compile.llm.LLM`` calls
``assemble``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("oscar_compile.runtime.serve")  # the name users' log filters were given


@dataclass(frozen=True)
class Wording:
    """How the caller's users name the arguments, in the errors ``assemble`` raises."""

    give_neither: str  # a compressed checkpoint was given a spec or rotations
    tensor_parallel: str  # the argument that asks for a split
    source_model: str  # what to do instead of splitting a compressed checkpoint


LIBRARY_WORDING = Wording("give neither", "tensor_parallel_size > 1",
                          "pass the source model with its spec and rotations")
CLI_WORDING = Wording("drop --spec / --rotations", "--tensor-parallel-size",
                      "serve the source model with --spec / --rotations")


@dataclass
class Assembly:
    """What ``assemble`` built. ``compression``: the compressed checkpoint's block, or None.
    ``tensor_parallel``: the other ranks (``close()`` stops them), or None on one device.
    ``name``: what a server calls the model unless told otherwise (its directory's name)."""

    model: torch.nn.Module  # rank 0's shard under tensor parallelism
    tokenizer: Any
    engine: Any  # oscar_compile.runtime.engine.LLMEngine
    compression: Any = None
    tensor_parallel: Any = None
    name: str | None = None


def assemble(model: str | Path | torch.nn.Module | None = None, spec=None, rotations=None, *, tokenizer=None,
             device: str | torch.device = "auto", dtype: torch.dtype | None = None, config=None, make_runner=None,
             tensor_parallel_size: int = 1, wording: Wording = LIBRARY_WORDING) -> Assembly:
    """The engine for ``model`` compressed with ``spec`` and ``rotations`` (arguments as ``LLM`` takes them).

    ``spec`` None: the plain model, run exactly by the uncached RecomputeRunner (or ``make_runner``).
    A spec (a CompressionSpec or a YAML path) is fitted to the model here, once; ``compress``
    and ``apply`` past this point take it as fitted.
    """
    from oscar_compile.checkpoint import compression_of
    from oscar_compile.loading import load_model, resolve_device, resolve_model_dir

    if rotations is not None and spec is None:
        raise ValueError("rotations were given without the spec they are applied with")
    if tensor_parallel_size != 1 and (isinstance(model, torch.nn.Module) or make_runner is not None):
        raise ValueError("tensor_parallel_size > 1 loads the model in every rank: pass a model directory "
                         "(not a loaded model or a make_runner)")
    compression, name = None, None
    if isinstance(model, torch.nn.Module):
        if tokenizer is None:
            raise ValueError("tokenizer is required when model is an nn.Module")
        fitted = None if spec is None else _fit(spec, model=model)
    else:
        model_dir = resolve_model_dir(model)
        compression = compression_of(model_dir)  # a compressed checkpoint brings its spec and rotations
        if compression is not None:
            if spec is not None or rotations is not None:
                raise ValueError(f"{model_dir} is a compressed checkpoint: it brings its own spec and rotations "
                                 f"({wording.give_neither})")
            if tensor_parallel_size != 1:
                raise ValueError(f"{model_dir} is a compressed checkpoint, whose value rotations are already folded "
                                 f"into the weights; {wording.tensor_parallel} splits a plain model: "
                                 f"{wording.source_model}")
            spec = compression.spec
        if tensor_parallel_size != 1:
            return _assemble_split(model_dir, spec, rotations, tokenizer, resolve_device(device), dtype, config,
                                   tensor_parallel_size)
        name = model_dir.name
        fitted = None if spec is None else _fit(spec, model_dir=model_dir)  # before loading weights
        model, loaded_tokenizer = load_model(model_dir, resolve_device(device), dtype)
        tokenizer = tokenizer or loaded_tokenizer
        if compression is not None:
            rotations = compression.load_rotations(model)
    if fitted is not None:
        from oscar_compile.compress import compress

        _, config, make_runner = compress(model, fitted, rotations, config, values_folded=compression is not None)
    from oscar_compile.runtime.engine_config import build_engine

    engine = build_engine(model, tokenizer, config, make_runner=make_runner)
    return Assembly(model, tokenizer, engine, compression, name=name)


def _fit(spec, model=None, model_dir=None):
    """The one fit of an assembly: ``spec`` (a CompressionSpec or a YAML path) fitted to the model."""
    from oscar_compile.spec import CompressionSpec
    from oscar_compile.spec_fit import fit_spec_to_model, fit_spec_to_model_dir

    if not isinstance(spec, CompressionSpec):
        spec = CompressionSpec.from_yaml(spec)
    return fit_spec_to_model(spec, model) if model_dir is None else fit_spec_to_model_dir(spec, model_dir)


def _assemble_split(model_dir: Path, spec, rotations, tokenizer, device: torch.device, dtype, config,
                    world_size: int) -> Assembly:
    """Rank 0's engine over ``world_size`` ranks; ``launch.start`` fits the spec (its own door)."""
    from oscar_compile.tensor_parallel import launch

    if spec is None:
        raise ValueError("tensor_parallel_size > 1 serves through the paged runtime: pass a spec "
                         "(specs/bf16.yaml for no compression)")
    group, model, tokenizer, engine = launch.start_engine(model_dir, spec, rotations, config, world_size, device,
                                                          dtype, tokenizer)
    return Assembly(model, tokenizer, engine, tensor_parallel=group, name=model_dir.name)


def default_compression(model_dir: Path, spec: str | None, rotations: str | None, bundled: bool
                        ) -> tuple[str, str | None]:
    """(spec path, rotations path or None) the server compresses a plain model with.

    The spec defaults to ``specs/oscar-int2.yaml`` for the bundled model, else ``specs/bf16.yaml``;
    the rotations to ``<model>/rotations/<spec name>.safetensors`` when that file exists."""
    from oscar_compile.spec import specs_dir

    spec = spec or str(specs_dir() / ("oscar-int2.yaml" if bundled else "bf16.yaml"))
    if rotations is None:
        shipped = Path(model_dir) / "rotations" / f"{Path(spec).stem}.safetensors"
        rotations = str(shipped) if shipped.is_file() else None
    return spec, rotations


def assemble_for_serving(model: str | Path | None = None, spec: str | None = None, rotations: str | None = None, *,
                         config=None, device: str | torch.device = "auto", tensor_parallel_size: int = 1,
                         wording: Wording = CLI_WORDING) -> Assembly:
    """The assembly a server runs for a model directory (None: the bundled model): a plain model
    is compressed with ``default_compression``'s spec and rotations where none are given.
    ``config``: the EngineConfig."""
    from oscar_compile.checkpoint import compression_of
    from oscar_compile.loading import resolve_device, resolve_model_dir

    model_dir = resolve_model_dir(model)
    device = resolve_device(device)
    if compression_of(model_dir) is None:
        spec, rotations = default_compression(model_dir, spec, rotations, bundled=model is None)
    built = assemble(model_dir, spec, rotations, device=device, config=config,
                     tensor_parallel_size=tensor_parallel_size, wording=wording)
    if built.compression is not None:
        spec, rotations = f"{model_dir} (compressed checkpoint)", built.compression.rotations_path
    logger.info("assembled %s on %s with %s (rotations: %s, tensor-parallel size %d)", model_dir, device, spec,
                rotations, tensor_parallel_size)
    return built


def build_app(built: Assembly, served_model_name: str | list[str] | None = None, server=None) -> tuple[Any, str]:
    """(FastAPI app, served model name): the OpenAI server over an assembly, the one app factory.

    ``served_model_name``: the names clients may use, responses report the first (default: the
    assembly's ``name``); ``server``: the ServerConfig (access and limits).
    ``app.state.tensor_parallel`` holds the other ranks (None on one device): stop them after
    the server."""
    from oscar_compile.runtime.async_engine import AsyncEngine
    from oscar_compile.runtime.server.app import create_app

    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    names = names or ([built.name] if built.name else [])
    if not names:
        raise ValueError("name the served model (served_model_name): the assembly has no directory name")
    logger.info("serving %s on %s", names[0], next(built.model.parameters()).device)
    app = create_app(AsyncEngine(built.engine), names, server)
    app.state.tensor_parallel = built.tensor_parallel  # the other ranks: stopped after the server
    return app, names[0]


__all__ = ["Assembly", "CLI_WORDING", "LIBRARY_WORDING", "Wording", "assemble", "assemble_for_serving", "build_app",
           "default_compression"]
