"""One prefill-semantics default everywhere (formats/prefill.py, ``DEFAULT_PREFILL_SEMANTICS``).

What is served must be what was evaluated (issue #31): the engine config, both serve commands
(and the random-model server built on their flags), the evaluation's config and command, the
compressed runner and ``generate()`` on a freshly applied model must not drift apart. The
default is decode-consistent since the rule of issue #31 was met at full size
(eval/results/2026-12-03-h200-prefill-semantics/).
"""

import argparse
import inspect

import torch

from oscar_compile import CompressionSpec, apply, calibrate
from oscar_compile.cli import build_parser as build_cli_parser
from oscar_compile.cli import serve as serve_cli
from oscar_compile.evaluation.command import config_from_args, configure_parser
from oscar_compile.evaluation.config import EvalConfig
from oscar_compile.formats.prefill import DECODE_CONSISTENT, DEFAULT_PREFILL_SEMANTICS, PROMPT_EXACT
from oscar_compile.passes.apply import set_prefill_semantics
from oscar_compile.runtime.engine_config import EngineConfig
from oscar_compile.runtime.worker.compressed_runner import CompressedRunner
from oscar_compile.testing import tiny_model


def test_the_default_is_decode_consistent():
    assert DEFAULT_PREFILL_SEMANTICS == DECODE_CONSISTENT


def test_engine_config_and_serve_commands_agree():
    assert EngineConfig().prefill_semantics == DEFAULT_PREFILL_SEMANTICS
    assert EngineConfig().prefix_hits == "snapshot"  # exact full hits come with the default
    serve_args = serve_cli.parse_args([])  # python -m oscar_compile.runtime.serve
    assert serve_args.prefill_semantics == DEFAULT_PREFILL_SEMANTICS
    assert serve_cli.engine_config(serve_args).prefill_semantics == DEFAULT_PREFILL_SEMANTICS
    cli_args = build_cli_parser().parse_args(["serve"])  # oscar-compile serve
    assert cli_args.prefill_semantics == DEFAULT_PREFILL_SEMANTICS
    assert serve_cli.parse_args(["--prefill-semantics", PROMPT_EXACT]).prefill_semantics == PROMPT_EXACT


def test_eval_config_and_command_agree():
    assert EvalConfig().prefill_semantics == DEFAULT_PREFILL_SEMANTICS
    args = configure_parser(argparse.ArgumentParser()).parse_args([])
    assert config_from_args(args).prefill_semantics == DEFAULT_PREFILL_SEMANTICS
    assert build_cli_parser().parse_args(["eval"]).prefill_semantics == DEFAULT_PREFILL_SEMANTICS


def test_the_compressed_runner_defaults_agree():
    default = inspect.signature(CompressedRunner).parameters["prefill_semantics"].default
    assert default == DEFAULT_PREFILL_SEMANTICS


def _applied_model():
    spec = CompressionSpec.from_dict({"kv_cache": {"bits": 2, "group_size": 16, "sink_tokens": 4,
                                                   "recent_tokens": 8, "page_size": 4},
                                      "key": {"rotation": "hadamard"}, "value": {"rotation": "hadamard"}})
    model = tiny_model("qwen3", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=64, seed=3)
    apply(model, spec, calibrate(model, spec))  # hadamard rotations need no data
    return model


def _cache_of_forward(model):
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, use_cache=True)
    return getattr(out, "cache", None) or out.past_key_values


def test_generate_on_a_freshly_applied_model_reads_the_default():
    """The cache a rewritten model's forward creates (``generate()``'s path) runs decode-consistent
    prefill until asked otherwise, and prompt-exact stays an option."""
    model = _applied_model()
    assert _cache_of_forward(model).decode_consistent is not None
    set_prefill_semantics(model, PROMPT_EXACT)
    assert _cache_of_forward(model).decode_consistent is None
