"""``oscar-compile``: calibrate, inspect, demo (and eval, where present) from the shell."""
from __future__ import annotations

import argparse
import logging
import sys

logger = logging.getLogger("oscar_compile")


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_model(model_dir: str, device: str = "auto", dtype: str = "auto"):
    """A Hugging Face causal LM and its tokenizer (None when the folder has none), offline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = _device(device)
    if dtype == "auto":
        torch_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    else:
        torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, attn_implementation="sdpa")
    model.to(dev).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer


def cmd_calibrate(args) -> int:
    from .calibration import calibrate
    from .calibration.data import load_tokens, make_batches
    from .spec import CompressionSpec
    from .spec_fit import fit_spec_to_model_dir

    spec = CompressionSpec.from_yaml(args.spec)
    if args.num_tokens:
        spec = spec.model_copy(update={"calibration": spec.calibration.model_copy(update={"num_tokens": args.num_tokens})})
    spec = fit_spec_to_model_dir(spec, args.model)  # the check `serve` runs too, before loading weights
    model, tokenizer = load_model(args.model, args.device, args.dtype)
    tokens = load_tokens(args.data, tokenizer, max_tokens=spec.calibration.num_tokens)
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    batches = make_batches(tokens, spec.calibration, bos)
    rot = calibrate(model, spec, batches, progress=not args.quiet)
    rot.save(args.out)
    print(f"wrote {args.out}: {rot.num_layers} layers, {rot.num_tokens} calibration tokens")
    return 0


def cmd_inspect(args) -> int:
    from .artifact import Rotations
    from .inspection import format_health

    print(format_health(Rotations.load(args.file)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oscar-compile", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("calibrate", help="calibrate rotations for a model and write a .safetensors artifact")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--spec", required=True, help="compression spec YAML")
    p.add_argument("--data", required=True, help="calibration text file, or token ids (.bin uint16 / .npy / .pt)")
    p.add_argument("--out", required=True, help="output rotation file (.safetensors)")
    p.add_argument("--num-tokens", type=int, default=None, help="override calibration.num_tokens")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("inspect", help="per-layer table of a rotation artifact")
    p.add_argument("file")
    p.set_defaults(func=cmd_inspect)

    from .runtime import serve

    p = sub.add_parser("serve", parents=[serve.build_parser(add_help=False)],
                       help="serve a model over the OpenAI API (as python -m oscar_compile.runtime.serve)")
    p.set_defaults(func=serve.serve)

    for extra in _extra_commands():
        extra(sub)
    return parser


def _extra_commands():
    """Subcommands that live beside their concern register themselves here."""
    from . import demo
    from .evaluation import cli as evaluation_cli

    return [demo.add_parser, evaluation_cli.add_parser]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as err:
        print(f"oscar-compile {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
