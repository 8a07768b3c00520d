"""``oscar-compile eval`` and ``python -m oscar_compile.evaluation``: the side-by-side comparison.

The command's options and its :func:`main` live here, in the evaluation, so that
``python -m oscar_compile.evaluation`` runs without the top-level CLI (``oscar_compile.cli``, which
sits above the evaluation and only registers this parser as its ``eval`` subcommand).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..formats.prefill import PREFILL_SEMANTICS
from .config import EvalConfig
from .names import BUILTIN_VARIANT_NAMES, DEFAULT_METHODS, NEEDLE_MODES, TASKS

HELP = "compare KV-cache compression methods side by side on held-out data (table, JSON, plots)"
EPILOG = f"""\
methods (--specs): spec .yaml files (named after the file stem), shipped spec names (the stems of
specs/*.yaml: bf16, naive-int2, hadamard-int2, oscar-int2, oscar-optr-int2, oscar-int4), \
built-in variants ({', '.join(BUILTIN_VARIANT_NAMES)}),
and the KIVI-style baseline kivi-int2 / kivi-int4 with optional -g<G> (group size, default 32)
and -r<R> (full-precision residual, default 128), e.g. kivi-int2-g128-r256.
Default: {' '.join(DEFAULT_METHODS)}.
The evaluation data and the calibration data must be different files (the same file is refused).
"""


def add_device_options(p: argparse.ArgumentParser) -> None:
    """--device and --dtype, as every command that loads a model for measuring reads them (eval, sweep)."""
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU) | bfloat16 | float32")


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = EvalConfig()
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the bundled oscar-tiny-qwen3)")
    p.add_argument("--specs", nargs="+", default=list(d.specs), metavar="SPEC", help="methods to compare (see below)")
    p.add_argument("--context", nargs="+", type=int, default=list(d.contexts), dest="contexts", metavar="C",
                   help="context lengths in tokens, BOS included (default: %(default)s)")
    p.add_argument("--rotations-dir", default=None, help="folder of <method>.safetensors rotation files to use "
                   "instead of calibrating")
    p.add_argument("--calib", default=None, help="calibration tokens/text (default: <model>/calib.bin)")
    p.add_argument("--data", default=None, help="held-out tokens/text (default: <model>/heldout.bin)")
    p.add_argument("--out", default="eval/results/latest", help="output folder (default: %(default)s)")
    p.add_argument("--num-samples", type=int, default=d.num_samples,
                   help="held-out windows per context (default: %(default)s)")
    p.add_argument("--ppl-tokens", type=int, default=d.ppl_tokens,
                   help="scored continuation tokens (default: %(default)s)")
    p.add_argument("--gen-tokens", type=int, default=d.gen_tokens,
                   help="greedy tokens for agreement (default: %(default)s)")
    p.add_argument("--metrics-context", type=int, default=None, help="window of the per-layer metrics "
                   "(default: the largest context)")
    p.add_argument("--metric-queries", type=int, default=d.metric_queries, help="scored query positions per "
                   "window for the per-layer metrics (default: %(default)s)")
    p.add_argument("--needle-per-cell", type=int, default=d.needle_per_cell, help="needle prompts per (length, "
                   "depth) (default: %(default)s; 0 skips)")
    p.add_argument("--needle-depths", nargs="+", type=float, default=list(d.needle_depths), metavar="D")
    p.add_argument("--needle-mode", choices=NEEDLE_MODES, default=d.needle_mode,
                   help="context: haystack cached, then the question; prompt: one prefill (default: %(default)s)")
    p.add_argument("--prefill-semantics", choices=PREFILL_SEMANTICS, default=d.prefill_semantics,
                   help="what prompt tokens read from the cache, as the engine's option of the same name: "
                   "decode-consistent (as a decode step at their position would) or prompt-exact (full precision "
                   "within the prompt) (default: %(default)s)")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS), help="tasks to run (default: all)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per forward (default: %(default)s)")
    p.add_argument("--calib-tokens", type=int, default=None, help="cap every spec's calibration.num_tokens "
                   "(quick runs; default: the spec's own)")
    add_device_options(p)
    p.add_argument("--seed", type=int, default=0, help="needle prompt seed")
    p.add_argument("--deterministic", action="store_true", help="batch-invariant matmuls and fixed attention "
                   "splits: scores independent of --batch-size and of the order of the windows")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    return EvalConfig(
        model=args.model, specs=tuple(args.specs), contexts=tuple(args.contexts), rotations_dir=args.rotations_dir,
        calib=args.calib, data=args.data, out=args.out, num_samples=args.num_samples, device=args.device,
        dtype=args.dtype, ppl_tokens=args.ppl_tokens, gen_tokens=args.gen_tokens, metrics_context=args.metrics_context,
        metric_queries=args.metric_queries, needle_per_cell=args.needle_per_cell,
        needle_depths=tuple(args.needle_depths), needle_mode=args.needle_mode, batch_size=args.batch_size,
        calib_tokens=args.calib_tokens,
        tasks=tuple(args.tasks), prefill_semantics=args.prefill_semantics, seed=args.seed, progress=not args.quiet,
        deterministic=args.deterministic)


def run(args: argparse.Namespace) -> int:
    from .runner import evaluate

    results = evaluate(config_from_args(args))
    print(Path(args.out, "results.md").read_text())
    print(f"wrote {', '.join(results['files'])} in {results['runtime_s']:.0f} s")
    return 0


def main(argv=None) -> int:
    """``python -m oscar_compile.evaluation [options]``: ``oscar-compile eval [options]``, with the
    same usage line and exit statuses (a user error: status 2 and one line on stderr)."""
    parser = configure_parser(argparse.ArgumentParser(prog="oscar-compile eval", description=HELP, epilog=EPILOG,
                                                      formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as err:
        print(f"oscar-compile eval: error: {err}", file=sys.stderr)
        return 2
