"""``oscar-compile sweep``: per-layer sensitivity and the mixed-precision spec at a bit budget."""
from __future__ import annotations

import argparse

from ..evaluation.command import add_device_options

HELP = "find per-layer KV precisions (INT2 / INT4 / 16-bit) that fit a bit budget with the least error"
DESCRIPTION = HELP + """.

Calibrates the base spec once, then on held-out windows (the end of --data, which must differ
from --calib) measures the continuation's KL to BF16 with the base spec and with each layer alone
stored at higher precision (INT4, taking the clip ratios of specs/oscar-int4.yaml, or 16-bit;
optionally smaller INT2 groups). An exact knapsack over layers then chooses the formats with the
largest summed KL reduction whose average asymptotic bits per element (eval's 'asymptotic'
column) is at most --budget. Writes the spec (--out, a .yaml that apply, eval --specs and serve
--spec load as they are) and .json, .md (per-layer table) and .png (sensitivity by layer) beside it.
Same inputs and --seed, same spec."""
EPILOG = """example:
  oscar-compile sweep --spec specs/oscar-int2.yaml --budget 2.5 3.0 --out specs/mixed/oscar-int2-{budget}.yaml
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``sweep`` on the ``oscar-compile`` subcommand parser."""
    p = subparsers.add_parser("sweep", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the bundled oscar-tiny-qwen3)")
    p.add_argument("--spec", default="oscar-int2",
                   help="base spec: a .yaml file or a shipped name (default: %(default)s)")
    p.add_argument("--budget", required=True, nargs="+", metavar="BITS",
                   help="average bits per element of the history, asymptotic (e.g. 2.5); several budgets share "
                        "one measurement")
    p.add_argument("--out", required=True, help="the mixed spec to write (.yaml); .json, .md, .png go beside it. "
                   "With several budgets it must contain {budget}, e.g. mixed-{budget}.yaml")
    p.add_argument("--data", default=None, help="held-out tokens/text (default: <model>/heldout.bin)")
    p.add_argument("--calib", default=None, help="calibration tokens/text (default: <model>/calib.bin)")
    p.add_argument("--rotations-dir", default=None,
                   help="folder with <spec name>.safetensors to use instead of calibrating")
    p.add_argument("--context", type=int, default=4096,
                   help="window length in tokens, BOS included (default: %(default)s)")
    p.add_argument("--scored-tokens", type=int, default=256,
                   help="continuation tokens scored per window (default: %(default)s)")
    p.add_argument("--num-windows", type=int, default=8, help="held-out windows (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward (default: %(default)s)")
    p.add_argument("--bits", nargs="+", type=int, default=[4, 16], choices=(4, 16), dest="upgrade_bits",
                   help="higher precisions offered per layer (default: 4 16)")
    p.add_argument("--group-sizes", nargs="+", type=int, default=[], metavar="G",
                   help="smaller groups offered at the base bits, e.g. 64 32 (default: none)")
    p.add_argument("--calib-tokens", type=int, default=None, help="cap the spec's calibration.num_tokens (quick runs)")
    add_device_options(p)
    p.add_argument("--seed", type=int, default=0, help="torch seed set before calibrating (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ..evaluation.sweep import SweepConfig, sweep_budgets
    from ..evaluation.sweep_report import layer_table, summary

    if len(args.budget) > 1 and "{budget}" not in args.out:
        raise ValueError("several budgets: --out must contain {budget}, e.g. specs/mixed/oscar-int2-{budget}.yaml")
    outs = [args.out.replace("{budget}", b) for b in args.budget]
    cfg = SweepConfig(spec=args.spec, budget=args.budget[0], model=args.model, data=args.data, calib=args.calib,
                      rotations_dir=args.rotations_dir, context=args.context, scored_tokens=args.scored_tokens,
                      num_windows=args.num_windows, batch_size=args.batch_size, upgrade_bits=tuple(args.upgrade_bits),
                      group_sizes=tuple(args.group_sizes), calib_tokens=args.calib_tokens, device=args.device,
                      dtype=args.dtype, seed=args.seed, progress=not args.quiet)
    for results in sweep_budgets(cfg, args.budget, outs):
        print(summary(results))
        print()
        print(layer_table(results))
        print(f"\nwrote {', '.join(results['files'])} ({results['runtime_s']:.0f} s since the start)\n")
    return 0
