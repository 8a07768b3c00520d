"""``oscar-compile calibrate`` and ``oscar-compile inspect``: make a rotation artifact, read one back."""
from __future__ import annotations


def cmd_calibrate(args) -> int:
    from ..calibration import calibrate
    from ..calibration.tokens import load_tokens, make_batches
    from ..loading import load_model, resolve_model_dir
    from ..spec import CompressionSpec, shipped_spec
    from ..spec_fit import fit_spec_to_model_dir

    model_dir = resolve_model_dir(args.model)
    data = args.data
    if data is None:
        data = model_dir / "calib.bin"
        if not data.is_file():
            raise FileNotFoundError(f"--data is required: {model_dir} ships no calib.bin (calibration token ids)")
    spec = CompressionSpec.from_yaml(args.spec) if args.spec else shipped_spec("oscar-int2")
    if args.num_tokens:
        spec = spec.model_copy(
            update={"calibration": spec.calibration.model_copy(update={"num_tokens": args.num_tokens})})
    spec = fit_spec_to_model_dir(spec, model_dir)  # the check `serve` runs too, before loading weights
    model, tokenizer = load_model(model_dir, args.device, args.dtype, tokenizer_required=False)
    tokens = load_tokens(data, tokenizer, max_tokens=spec.calibration.num_tokens)
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    batches = make_batches(tokens, spec.calibration, bos)
    rot = calibrate(model, spec, batches, progress=not args.quiet)
    rot.save(args.out)
    print(f"wrote {args.out}: {rot.num_layers} layers, {rot.num_tokens} calibration tokens")
    return 0


def cmd_inspect(args) -> int:
    from ..artifact import Rotations
    from ..inspection import format_health

    print(format_health(Rotations.load(args.file)))
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("calibrate", help="calibrate rotations for a model and write a .safetensors artifact")
    p.add_argument("--model", help="Hugging Face model directory (default: the bundled tiny model)")
    p.add_argument("--spec", help="compression spec YAML (default: the shipped oscar-int2)")
    p.add_argument("--data", help="calibration text file, or token ids (.bin uint16 / .npy / .pt) "
                                  "(default: the model's calib.bin, which the bundled model ships)")
    p.add_argument("--out", required=True, help="output rotation file (.safetensors)")
    p.add_argument("--num-tokens", type=int, default=None, help="override calibration.num_tokens")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("inspect", help="per-layer table of a rotation artifact")
    p.add_argument("file")
    p.set_defaults(func=cmd_inspect)
