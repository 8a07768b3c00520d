"""``export_onnx``: the step and quantize graphs of a compressed model, for ONNX Runtime on the CPU.

Writes to ``out_dir``: ``step.onnx`` (weights inside), ``quantize.onnx`` and ``manifest.json``
(what the numpy driver, ``oscar_compile.onnx.OnnxGenerator``, needs: shapes, windows, bits, the
graphs' input and output names, EOS ids) plus the tokenizer files. Graphs use opset 21 and
standard ops only; both pass ``onnx.checker``.

2-bit codes travel as uint8 in the cache format's byte order (docs/cache-format.md): planar rows,
or, for INT2 at head_dim 128, masked 16-token blocks (the manifest's ``code_layout`` and
``cache_format_version``, which the driver checks), unpacked with Gather / BitShift / BitwiseAnd
/ BitwiseXor: ONNX 1.20 (opset 25) has UINT2 and ``DequantizeLinear`` over it, but our zero point is
fractional (z = -min / s), which DequantizeLinear cannot take, and the uint2 element order
(consecutive elements per byte) is not our planar one; the unpack + ``s * (code - z)`` is the
reference dequantization op for op (``quant.dequantize``), so the graph matches it bitwise.

The export runs in float32 (the CPU dtype of ``oscar_compile.loading``), batch 1.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from .._version import __version__
from ..architectures import ModelFingerprint, attention_modules
from ..artifact import Rotations
from ..checkpoint import compression_of, write_tokenizer
from ..formats.cache import CACHE_FORMAT_VERSION, MASKED_BLOCK_TOKENS, code_layout
from ..kernels.layout.code_layout_ref import BLOCK_BYTES
from ..loading import load_model
from ..passes.apply import resolve_layers
from ..passes.fold_values import fold_value_rotation
from ..spec import CompressionSpec
from ..spec_fit import fit_spec_to_model
from .graphs import CACHE_FIELDS, QuantizeGraph, StepGraph, cache_input_names, new_kv_output_names

logger = logging.getLogger(__name__)

OPSET = 21
MANIFEST = "manifest.json"
FORMAT = "oscar_compile.onnx"
FORMAT_VERSION = 2  # 2: cache_format_version and code_layout in the manifest (onnx/driver.py)
QUANTIZE_OUTPUTS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")


def uniform_layer(spec: CompressionSpec, num_layers: int):
    """The one LayerSpec every layer shares; the ONNX export takes no per-layer overrides."""
    layers = resolve_layers(spec, num_layers)
    first = layers[0]
    for layer in layers[1:]:
        if layer.model_dump(exclude={"index"}) != first.model_dump(exclude={"index"}):
            raise NotImplementedError("the ONNX export takes one cache format for every layer (no per-layer "
                                      "overrides): export a spec without `layers:`")
    if first.kv_cache.scale_dtype not in ("float16", "float32"):
        raise NotImplementedError(f"the ONNX driver holds scales in numpy, which has no {first.kv_cache.scale_dtype}: "
                                  "export a spec with kv_cache.scale_dtype float16 or float32")
    if first.kv_cache.bits not in (2, 4):
        raise NotImplementedError(f"the ONNX export quantizes the history (bits 2 or 4), "
                                  f"got bits {first.kv_cache.bits}")
    return first


def _shift_translations() -> dict:
    """ONNX for the uint8 shifts of the code packing: one BitShift each.

    The exporter's own translation emulates an arithmetic (signed) shift through int8 casts, which
    ONNX Runtime then refuses beside uint8 operands; codes are unsigned, so a logical BitShift is
    the exact op. BitShift takes unsigned types only: a signed shift would fail loudly in the checker.
    """
    from onnxscript import opset21 as op

    def right(x, n):
        return op.BitShift(x, op.CastLike(n, x), direction="RIGHT")

    def left(x, n):
        return op.BitShift(x, op.CastLike(n, x), direction="LEFT")

    aten = torch.ops.aten
    return {aten.__rshift__.Scalar: right, aten.__lshift__.Scalar: left,
            aten.bitwise_right_shift.Tensor_Scalar: right, aten.bitwise_left_shift.Tensor_Scalar: left,
            aten.__rshift__.Tensor: right, aten.bitwise_right_shift.Tensor: right}  # masked blocks: per-code shifts


def _export(module: torch.nn.Module, args: tuple, path: Path, input_names: list[str], output_names: list[str],
            dynamic_shapes: tuple) -> None:
    import onnx

    torch.onnx.export(module, args, str(path), dynamo=True, input_names=input_names, output_names=output_names,
                      dynamic_shapes=dynamic_shapes, opset_version=OPSET, optimize=True, external_data=False,
                      custom_translation_table=_shift_translations(), verbose=False)
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)


def onnx_code_layout(bits: int, head_dim: int) -> str:
    """The byte order of the export's history codes: the cache format's for 16-token pages (the
    driver's history is a run of 16-token blocks when it is masked)."""
    return code_layout(bits, head_dim, MASKED_BLOCK_TOKENS)


def _example_cache(num_layers: int, H: int, D: int, layer, masked: bool) -> list[torch.Tensor]:
    """Cache inputs of a step that has 2 sink, 3 history and 4 recent tokens (sizes are dynamic;
    masked codes: 2 blocks, so the exporter sees blocks and rows as separate sizes).

    Distinct tensors per layer: given one object twice, the exporter would bind both layers to
    one graph input."""
    kv = layer.kv_cache
    sdt = getattr(torch, kv.scale_dtype)
    width, groups = D * kv.bits // 8, D // kv.group_size
    codes = (2, H, BLOCK_BYTES) if masked else (3, H, width)
    one = [torch.randn(2, H, D), torch.randn(2, H, D),
           torch.randint(0, 255, codes, dtype=torch.uint8), torch.rand(3, H, groups).to(sdt),
           torch.rand(3, H, groups).to(sdt), torch.randint(0, 255, codes, dtype=torch.uint8),
           torch.rand(3, H, groups).to(sdt), torch.rand(3, H, groups).to(sdt),
           torch.randn(4, H, D), torch.randn(4, H, D)]
    return [t.clone() for _ in range(num_layers) for t in one]


def _dynamic_cache_shapes(num_layers: int, masked: bool) -> list[dict]:
    sink, hist, recent = (torch.export.Dim(n, min=0) for n in ("num_sink", "num_history", "num_recent"))
    per_field = {"sink_k": sink, "sink_v": sink, "recent_k": recent, "recent_v": recent}
    if masked:
        blocks = torch.export.Dim("num_history_blocks", min=0)
        per_field.update(hist_k_codes=blocks, hist_v_codes=blocks)
    return [{0: per_field.get(name, hist)} for _ in range(num_layers) for name in CACHE_FIELDS]


def export_onnx(model_dir: str | Path, spec: CompressionSpec | str | Path,
                rotations: Rotations | str | Path | None, out_dir: str | Path,
                progress: bool = False) -> str:
    """Export ``model_dir`` compressed with ``spec`` to ``out_dir``; returns a one-line summary."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} exists and is not empty: give a new directory")
    if compression_of(model_dir) is not None:  # its R_V is folded already: folding again changes the basis
        raise ValueError(f"{model_dir} is a compressed checkpoint (R_V already folded into its weights): "
                         "export ONNX from its source model with --spec / --rotations")
    model, tokenizer = load_model(model_dir, "cpu", torch.float32, tokenizer_required=False)
    if not isinstance(spec, CompressionSpec):
        spec = CompressionSpec.from_yaml(spec)
    spec = fit_spec_to_model(spec, model)
    fp = ModelFingerprint.of(model)
    layer = uniform_layer(spec, fp.num_layers)
    if rotations is None:
        from ..calibration import calibrate

        rotations = calibrate(model, spec)  # data-free rotations only (none / hadamard)
    elif not isinstance(rotations, Rotations):
        rotations = Rotations.load(rotations, model)
    rotations.check_model(model)
    if layer.key.center and any(m is None for m in rotations.k_mean):
        raise ValueError("key.center is on but the rotation file has no key means (recalibrate)")
    steps = tqdm(total=2, desc="export onnx", disable=not progress)
    with torch.no_grad():
        if layer.value.rotation != "none":
            for i, attn in enumerate(attention_modules(model)):
                fold_value_rotation(attn.v_proj, attn.o_proj, rotations.v[i], fp.num_heads)
        identity = torch.eye(fp.head_dim).expand(fp.num_kv_heads, -1, -1)
        rot_k = rotations.k if layer.key.rotation != "none" else [identity] * fp.num_layers
        means = rotations.k_mean if layer.key.center else [None] * fp.num_layers
        kv = layer.kv_cache
        out_dir.mkdir(parents=True, exist_ok=True)
        masked = onnx_code_layout(kv.bits, fp.head_dim) == "masked"
        step = StepGraph(model, rot_k, means, kv.bits, kv.group_size, masked).eval()
        T = torch.export.Dim("num_new", min=1)
        ids = torch.randint(0, fp_vocab(model), (1, 3))
        _export(step, (ids, torch.arange(9, 12).view(1, 3),
                       *_example_cache(fp.num_layers, fp.num_kv_heads, fp.head_dim, layer, masked)),
                out_dir / "step.onnx", ["input_ids", "position_ids", *cache_input_names(fp.num_layers)],
                ["logits", *new_kv_output_names(fp.num_layers)],
                ({1: T}, {1: T}, tuple(_dynamic_cache_shapes(fp.num_layers, masked))))  # *cache: one nested tuple
        steps.update()
        quantize = QuantizeGraph(kv.bits, kv.group_size, layer.key.clip_ratio, layer.value.clip_ratio,
                                 kv.scale_dtype, masked).eval()
        n = torch.export.Dim("num_tokens", min=1)
        x = torch.randn(2, fp.num_kv_heads, fp.head_dim)
        _export(quantize, (x, x.clone()), out_dir / "quantize.onnx", ["k", "v"], list(QUANTIZE_OUTPUTS),
                ({0: n}, {0: n}))
        steps.update()
    steps.close()
    _write_manifest(out_dir, model, tokenizer, fp, layer)
    write_tokenizer(model_dir, out_dir, tokenizer)
    size = sum(p.stat().st_size for p in out_dir.glob("*.onnx"))
    return (f"wrote {out_dir}: step.onnx + quantize.onnx ({size / 2**20:.1f} MiB), {fp.num_layers} layers, "
            f"INT{kv.bits} history")


def _layout_maps() -> dict:
    """Where the masked layout puts each (token row, channel) code: byte and bit pair [16][128] per
    kind, from ``code_layout_ref`` (the driver, numpy only, writes demoted tokens with them)."""
    from ..kernels.layout.code_layout_ref import key_byte_map, value_byte_map

    return {kind: {"byte": byte.tolist(), "pair": pair.tolist()}
            for kind, (byte, pair) in (("k", key_byte_map()), ("v", value_byte_map()))}


def fp_vocab(model) -> int:
    return model.config.get_text_config().vocab_size


def _write_manifest(out_dir: Path, model, tokenizer, fp: ModelFingerprint, layer) -> None:
    from ..runtime.engine_config import eos_token_ids

    kv = layer.kv_cache
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "library_version": __version__, "opset": OPSET,
        "cache_format_version": CACHE_FORMAT_VERSION, "code_layout": onnx_code_layout(kv.bits, fp.head_dim),
        **({"code_layout_maps": _layout_maps()} if onnx_code_layout(kv.bits, fp.head_dim) == "masked" else {}),
        "num_layers": fp.num_layers, "num_kv_heads": fp.num_kv_heads, "head_dim": fp.head_dim,
        "vocab_size": fp_vocab(model),
        "max_position_embeddings": model.config.get_text_config().max_position_embeddings,
        "bits": kv.bits, "group_size": kv.group_size, "scale_dtype": kv.scale_dtype,
        "sink_tokens": kv.sink_tokens, "recent_tokens": kv.recent_tokens, "window_dtype": "float32",
        "clip_k": layer.key.clip_ratio, "clip_v": layer.value.clip_ratio,
        "key_rotation": layer.key.rotation, "value_rotation": layer.value.rotation, "key_center": layer.key.center,
        "eos_token_ids": eos_token_ids(model, tokenizer), "cache_fields": list(CACHE_FIELDS),
        "step": {"graph": "step.onnx", "inputs": ["input_ids", "position_ids", *cache_input_names(fp.num_layers)],
                 "outputs": ["logits", *new_kv_output_names(fp.num_layers)]},
        "quantize": {"graph": "quantize.onnx", "inputs": ["k", "v"], "outputs": list(QUANTIZE_OUTPUTS)},
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
