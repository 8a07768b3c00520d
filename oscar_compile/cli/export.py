"""``oscar-compile export``: write a compressed model for another loader or runtime.

``--format hf``: a self-contained compressed Hugging Face checkpoint (``oscar_compile.checkpoint``)
that ``LLM(dir)`` and ``serve --model dir`` run with no other flags. ``--format onnx``: ONNX graphs
with an INT2 KV cache for ONNX Runtime (``oscar_compile.onnx``).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

# What --format onnx imports (the [onnx] extra): checked before anything is loaded or written.
ONNX_MODULES = ("onnx", "onnxscript", "onnxruntime")


def missing_onnx_modules() -> list[str]:
    return [name for name in ONNX_MODULES if importlib.util.find_spec(name) is None]


def _spec_and_rotations(args, model_dir: Path) -> tuple[str, str | None]:
    from ..spec import specs_dir

    spec = args.spec
    if spec is None:
        if args.model is not None:
            raise ValueError("--spec is required with --model (the bundled model defaults to oscar-int2)")
        spec = str(specs_dir() / "oscar-int2.yaml")
    rotations = args.rotations
    if rotations is None:
        shipped = model_dir / "rotations" / f"{Path(spec).stem}.safetensors"
        rotations = str(shipped) if shipped.is_file() else None
    return spec, rotations


def _checkpoint_dtype(model_dir: Path) -> str | None:
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("dtype") or config.get("torch_dtype")


def cmd_export(args) -> int:
    from ..loading import load_model, resolve_model_dir
    from ..spec import CompressionSpec
    from ..spec_fit import fit_spec_to_model_dir

    if args.format == "onnx" and (missing := missing_onnx_modules()):
        raise ValueError(f"--format onnx needs {', '.join(missing)}: "
                         "pip install 'oscar-compile[onnx]' (nothing written)")
    model_dir = resolve_model_dir(args.model)
    spec_path, rotations = _spec_and_rotations(args, model_dir)
    spec = fit_spec_to_model_dir(CompressionSpec.from_yaml(spec_path), model_dir)  # the one fit, before loading
    if args.format == "hf":
        from ..checkpoint import save_compressed

        dtype = _checkpoint_dtype(model_dir) if args.dtype == "auto" else args.dtype
        model, tokenizer = load_model(model_dir, "cpu", dtype, tokenizer_required=False)
        if rotations is None:
            from ..calibration import calibrate

            rotations = calibrate(model, spec)  # data-free only
        out = save_compressed(model, spec, rotations, args.out, tokenizer=tokenizer)
        print(f"wrote {out}: compressed Hugging Face checkpoint ({dtype} weights, R_V folded)")
        return 0
    from ..onnx.export import export_onnx

    summary = export_onnx(model_dir, spec, rotations, args.out, progress=not args.quiet)
    print(summary)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a compressed Hugging Face checkpoint (--format hf) or ONNX graphs "
                                      "with an INT2 KV cache (--format onnx)")
    p.add_argument("--format", choices=("hf", "onnx"), required=True)
    p.add_argument("--model", help="Hugging Face model directory (default: the bundled tiny model)")
    p.add_argument("--spec", help="compression spec YAML (default for the bundled model: oscar-int2)")
    p.add_argument("--rotations", help="rotation artifact (default: <model>/rotations/<spec name>.safetensors; "
                                       "none: data-free rotations, which only none / hadamard specs allow)")
    p.add_argument("--out", required=True, help="output directory (new or empty)")
    p.add_argument("--dtype", default="auto",
                   help="hf: weight dtype, auto = the one the source's config.json names (float32 if it names "
                        "none) | float32 | bfloat16 | float16")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_export)
