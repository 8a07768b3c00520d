"""``apply(model, spec, rotations)``: rewrite every attention layer of a model in place.

Per layer: trace the attention forward (trace.py), find its pieces (sites.py), fold R_V into the
weights (fold_values.py), rotate keys and queries after RoPE (rotate_keys.py; with ``fuse``, one
``oscar::rope`` node does RoPE and the rotation, fuse_elementwise.py), and swap the attention for
the oscar ops (swap_attention.py). With ``fuse``, RMSNorms and gated MLPs get fused ops too, and
q/k/v and gate/up one GEMM each (merge_projections.py). The rewritten graph becomes the module's
forward; it stays inspectable as ``module.oscar_graph`` (a GraphModule: print its ``.graph`` or
``.code``). A forward pre-hook on the model hands the rewritten layers an
:class:`~oscar_compile.cache.hf_cache.OscarCache` whenever the model is asked to cache.

``apply`` returns a :class:`~oscar_compile.passes.compressed_model.CompressedModel`: the report,
the layers' cache formats and op constants, and the prefill semantics, which the hook reads. No
attribute is left on the model itself: :func:`set_prefill_semantics`, which takes the model, finds
its handle in ``_HANDLES``, and a rewritten model is told by its attention modules' ``oscar_graph``.
Nothing outside ``passes/`` reads or writes an ``_oscar_*`` or ``oscar_graph`` attribute
(tests/test_import_rules.py).
"""
from __future__ import annotations

import inspect
import logging
import types
import weakref

import torch
from torch import nn

from ..architectures import ModelFingerprint, attention_modules
from ..artifact import COMPRESSED_CONFIG_KEY, ArtifactError, Rotations
from ..cache.attention_core import graph_attention_core
from ..cache.hf_cache import OscarCache
from ..cache.op_constants import OpConstants, graph_op_constants
from ..formats.cache import LayerFormat, has_windows
from ..spec import CompressionSpec, LayerSpec
from ..spec_fit import fit_spec
from .compressed_model import CompressedModel
from .fold_values import fold_value_rotation
from .fuse_elementwise import fuse_gated_mlps, fuse_rms_norms, fuse_rope
from .merge_projections import merge_qkv
from .report import ApplyReport, LayerReport
from .rotate_keys import insert_key_rotation
from .sites import find_attention_site
from .swap_attention import swap_in_oscar_attention
from .trace import trace_attention

logger = logging.getLogger(__name__)
_GRAPH = "oscar_graph"  # the rewritten GraphModule, on each attention module (inspection: its .code)
# model -> a weak reference to the handle apply returned for it: weak both ways, so this keeps
# neither alive (the model's forward pre-hook holds the handle, and the handle holds the model)
_HANDLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _oscar_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                   cache=None, **kwargs):
    """The attention module's new forward: HF calling convention in, the rewritten graph underneath."""
    cos, sin = position_embeddings
    cache = cache if cache is not None else past_key_values
    return type(self.oscar_graph).forward(self, hidden_states, cos, sin, attention_mask, cache)


def _set_buffer(modules: list[nn.Module], name: str, value: torch.Tensor) -> None:
    for m in modules:
        m.register_buffer(name, value, persistent=False)


def _rewrite_layer(attn: nn.Module, layer: LayerSpec, rot: Rotations, fp: ModelFingerprint, fuse: bool,
                   values_folded: bool) -> tuple[LayerReport, tuple[int, OpConstants] | None, tuple | None]:
    """Rewrite one attention module: its report, (layer index, the constants of its INT-b op
    calls) as its graph passes them (None on a layer of full-precision pages), and (layer index,
    its attention core) (cache/attention_core.py; None where the graph has none)."""
    i = layer.index
    gm = trace_attention(attn)
    graph = gm.graph
    site = find_attention_site(graph)
    device = attn.o_proj.weight.device
    notes = []
    folded = layer.value.rotation != "none"
    if folded and not values_folded:  # a compressed checkpoint's weights hold R_V already
        fold_value_rotation(attn.v_proj, attn.o_proj, rot.v[i], fp.num_heads)
    mean = rot.k_mean[i] if layer.key.center else None
    if layer.key.center and mean is None:
        raise ArtifactError(f"layer {i}: key.center is on but the rotation file has no key means (recalibrate)")
    rotate = layer.key.rotation != "none" or mean is not None  # an identity rotation would only cost time
    if rotate:
        owners = [attn, gm]
        _set_buffer(owners, "oscar_rot_k", rot.k[i].to(device=device, dtype=torch.float32))
        if mean is not None:
            _set_buffer(owners, "oscar_k_mean", mean.to(device=device, dtype=torch.float32))
    rope_fused = fuse and fuse_rope(graph, site, rotate, has_mean=mean is not None)
    if not rope_fused:
        if fuse:
            notes.append("RoPE not fused: not the rotate-half formula")
        if rotate:
            insert_key_rotation(graph, site, has_mean=mean is not None)
    qkv_merged = fuse and merge_qkv([attn, gm], graph)
    attention = swap_in_oscar_attention(graph, site, layer, float(attn.scaling))
    window = _sliding_window(attn)
    if window:
        notes.append(f"sliding window {window} not applied: attends to the whole context")
    graph.lint()
    gm.recompile()
    attn.__dict__[_GRAPH] = gm  # not a submodule: its parameters are the module's own
    attn.forward = types.MethodType(_oscar_forward, attn)
    if layer.overridden_to_16_bits:
        notes.append("overridden to 16 bits: not rotated, keys and values stored as they are")
    return (LayerReport(i, layer.kv_cache.bits, layer.key.rotation, layer.value.rotation,
                        mean is not None, folded, attention, notes, rope_fused, qkv_merged),
            graph_op_constants(graph), graph_attention_core(graph))


def _sliding_window(attn: nn.Module) -> int | None:
    """The window the model's own attention would apply: Qwen-style modules hold it (None on
    full-attention layers), Mistral-style ones pass ``config.sliding_window`` at every call."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return getattr(getattr(attn, "config", None), "sliding_window", None)


def resolve_layers(spec: CompressionSpec, num_layers: int) -> list[LayerSpec]:
    """The spec per layer, as ``apply`` rewrites it.

    - A layer overridden to ``bits: 16`` is not rotated (its weights stay untouched) and stores
      its keys and values as they are, with the same windows and page tables as the INT-b layers.
    - With no layer quantized, the windows are dropped: every token sits in a full-precision page
      (the classic paged cache, the runtime's BF16 mode); windows would only add a second table.
    """
    layers = [spec.for_layer(i, num_layers) for i in range(num_layers)]
    windowless = not has_windows(layer.kv_cache.bits for layer in layers)
    out = []
    for layer in layers:
        if layer.overridden_to_16_bits:
            layer = layer.model_copy(update={"key": layer.key.model_copy(update={"rotation": "none", "center": False}),
                                             "value": layer.value.model_copy(update={"rotation": "none"})})
        if windowless:
            layer = layer.model_copy(update={"kv_cache": layer.kv_cache.model_copy(
                update={"sink_tokens": 0, "recent_tokens": 0})})
        out.append(layer)
    return out


def _install_cache_hook(handle: CompressedModel) -> None:
    """Give the model an OscarCache whenever it is asked to cache and was given none (or an empty
    HF one): its layers' formats, and the handle's prefill semantics as they stand at that forward."""
    model = handle.model
    # transformers renamed past_key_values to cache (5.2x); use whichever this version's forward takes
    default_key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def hook(module, args, kwargs):
        key = next((k for k in ("cache", "past_key_values") if kwargs.get(k) is not None), default_key)
        cache = kwargs.get(key)
        if kwargs.get("use_cache") is False and cache is None:
            return None
        if not isinstance(cache, OscarCache):
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError("this model was rewritten by oscar_compile: continue with the OscarCache it returned")
            cache = OscarCache(list(handle.formats), handle.decode_consistent)
            kwargs[key] = cache
        ids = kwargs.get("input_ids", args[0] if args else None)
        num_new = (ids if ids is not None else kwargs["inputs_embeds"]).shape[1]
        cache.begin_step(kwargs.get("attention_mask"), num_new)
        kwargs["use_cache"] = True
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)


def is_rewritten(model: nn.Module) -> bool:
    """Whether :func:`apply` rewrote ``model`` (which then refuses what needs the model as loaded:
    a second ``apply``, ``save_compressed``, a tensor-parallel split)."""
    return any(_GRAPH in module.__dict__ for module in model.modules())


def set_prefill_semantics(model: nn.Module, semantics: str) -> None:
    """What prompt tokens of ``model`` (rewritten by :func:`apply`) read from the caches its forward
    creates (``generate()``, ``model(..., use_cache=True)``): ``decode-consistent`` (the default,
    which :func:`apply` sets) or ``prompt-exact`` (formats/prefill.py), as the engine's
    ``prefill_semantics``. The same as ``apply(...).set_prefill_semantics(semantics)``."""
    ref = _HANDLES.get(model)
    handle = None if ref is None else ref()
    if handle is None:
        raise ValueError("set_prefill_semantics needs a model rewritten by oscar_compile.apply")
    handle.set_prefill_semantics(semantics)


def apply(model: nn.Module, spec: CompressionSpec, rotations: Rotations, fuse: bool = True,
          values_folded: bool = False) -> CompressedModel:
    """Rewrite ``model`` (a supported HF causal LM) in place; returns the handle on the result: what
    was done per layer (``.report``), the layers' cache formats and op constants, and the prefill
    semantics of its ``generate()`` (decode-consistent, the engine's default).

    ``fuse``: also swap RMSNorm, RoPE (with the key rotation) and the MLP's SiLU-product for the
    fused ``oscar::`` ops (fuse_elementwise.py), and run q/k/v and gate/up as one GEMM each
    (merge_projections.py): same values on the CPU, a fraction of the kernel launches on a GPU.
    Off, the model keeps its own code (e.g. to measure the gain). Move the model to its device
    before: the merged GEMMs' weights are shared views that a later ``.to()`` would copy apart.

    ``values_folded``: the weights already hold R_V (a compressed checkpoint written by
    ``save_compressed``; ``load_compressed`` passes it), so it is not folded a second time. A model
    whose config carries the compressed-checkpoint block is refused without it.
    """
    if is_rewritten(model):
        raise RuntimeError("oscar_compile.apply was already applied to this model; load a fresh copy to apply again")
    if getattr(getattr(model, "config", None), COMPRESSED_CONFIG_KEY, None) and not values_folded:
        raise ArtifactError("this model was loaded from a compressed checkpoint (R_V is already folded into its "
                            "weights): load it with oscar_compile.load_compressed(dir)")
    modules = attention_modules(model)  # refuses unknown architectures
    rotations.check_model(model)
    fp = ModelFingerprint.of(model)
    spec = fit_spec(spec, fp.head_dim, fp.num_layers, fp.architecture)  # before any rewrite
    layers = resolve_layers(spec, fp.num_layers)
    rewritten = [_rewrite_layer(attn, layer, rotations, fp, fuse, values_folded)
                 for layer, attn in zip(layers, modules, strict=True)]
    reports = [report for report, _, _ in rewritten]
    fused = {}
    if fuse:
        silu_mul, gate_up = fuse_gated_mlps(model)
        fused = {"rms_norm": fuse_rms_norms(model), "silu_mul": silu_mul, "rope": sum(r.rope_fused for r in reports),
                 "qkv_gemm": sum(r.qkv_merged for r in reports), "gate_up_gemm": gate_up}
    handle = CompressedModel(model, ApplyReport(fp, reports, spec, fused),
                             formats=tuple(LayerFormat.of(layer) for layer in layers),
                             constants=dict(found for _, found, _ in rewritten if found is not None),
                             attention_cores=dict(core for _, _, core in rewritten if core is not None))
    _install_cache_hook(handle)
    _HANDLES[model] = weakref.ref(handle)
    logger.info("oscar_compile rewrote %d layers, %d quantized", len(reports), sum(layer.quantized for layer in layers))
    return handle
