"""Serve a random-weight Qwen3 of a benchmark shape: ``python -m oscar_compile.bench.serve_random``.

    python -m oscar_compile.bench.serve_random --shape 8b [--mode int2|bf16] [serve options]

For load tests at a real model's size without its weights: the shapes of
``oscar_compile.bench.serve`` (``8b``: Qwen3-8B's layers, heads and vocabulary), rewritten by
``apply`` with ``hadamard-int2`` (``int2``: the cost of OSCAR, no calibration data needed) or
``bf16`` (the runtime's BF16 mode). The tokenizer is ``SpelledIdTokenizer`` (token n is the text
" tn"): send token-id prompts; there is no chat template. Every other flag is the serve CLI's.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("oscar_compile.bench.serve_random")
_DEFAULT_MAX_MODEL_LEN = 4096


def parse_args(argv: list[str] | None = None):
    from oscar_compile.bench.serve_models import MODES, SHAPES
    from oscar_compile.cli import serve

    parser = serve.build_parser(prog="python -m oscar_compile.bench.serve_random")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--mode", choices=sorted(MODES), default="int2")
    args = parser.parse_args(argv)
    for name in ("model", "spec", "rotations"):
        if getattr(args, name) is not None:
            parser.error(f"--{name} does not apply: the model is random and its spec comes from --mode")
    if args.tensor_parallel_size != 1:  # the ranks would each need the same random model: not wired here yet
        parser.error("--tensor-parallel-size is not supported for random models here; "
                     "python -m oscar_compile.bench.serve --tensor-parallel-size times split random models")
    return args


def assemble_random(args):
    """The assembly of a random model of ``args.shape`` in ``args.mode`` (served by ``assembly.build_app``)."""
    from oscar_compile.assembly import Assembly
    from oscar_compile.bench.e2e import SpelledIdTokenizer
    from oscar_compile.bench.serve_models import mode_spec, random_model
    from oscar_compile.cli import serve
    from oscar_compile.compress import compress
    from oscar_compile.runtime.engine_config import build_engine, resolve_device

    max_len = args.max_model_len or _DEFAULT_MAX_MODEL_LEN
    model = random_model(args.shape, max_len, resolve_device(args.device))
    spec = mode_spec(args.shape, args.mode)
    _, config, make_runner = compress(model, spec, None, serve.engine_config(args))  # neither needs data
    tokenizer = SpelledIdTokenizer(model.config.get_text_config().vocab_size)
    logger.info("random weights, %s", spec)
    return Assembly(model, tokenizer, build_engine(model, tokenizer, config, make_runner=make_runner),
                    name=f"random-{args.shape}-{args.mode}")


def main(argv: list[str] | None = None) -> int:
    from oscar_compile.assembly import build_app
    from oscar_compile.cli import serve

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = serve.server_config(args)  # refuse bad flags before building the model
        app, _ = build_app(assemble_random(args), args.served_model_name, server)
    except (FileNotFoundError, ValueError, NotImplementedError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    serve.run_server(app, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
