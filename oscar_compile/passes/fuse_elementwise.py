"""Swap chains of small kernels for the fused ``oscar::`` ops: RMSNorm, RoPE (+ R_K), SiLU-mul.

(The gated MLP's gate and up projections also become one GEMM here: merge_projections.py.)

Why: at batch 1 a decode step is bound by kernel launches, not bytes: each layer runs four
RMSNorms of eight kernels, a RoPE of about ten, two rotations of four, and the MLP's SiLU and
product, ~45 launches that the fused ops do in 6 (kernels/elementwise/elementwise_ref.py). With the GEMMs
and attention fixed, these launches are what is left of the step.

Nothing is swapped on faith: before a module's forward (or a traced ``apply_rotary_pos_emb``) is
replaced, it and the op's reference run on the same probe inputs and must agree bitwise. What
differs, e.g. a Gemma-style ``(1 + w)`` norm or an interleaved RoPE, is left as it is. On the CPU
the references are the Hugging Face formulas op for op, so a fused model's logits do not change.
"""
from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from ..formats.op_args import RopeArgs, op_of
from ..kernels.elementwise.elementwise_ref import rms_norm_ref, rope_ref
from .merge_projections import merge_gate_up
from .sites import AttentionSite

_PROBE_DTYPES = (torch.float32, torch.bfloat16)


def _probe(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


# ------------------------------------------------------------------ RMSNorm modules
def _rms_epsilon(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _fused_rms_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return torch.ops.oscar.rms_norm(hidden_states, self.weight, self.oscar_eps)


def _computes_rms_norm(module: nn.Module, eps: float) -> bool:
    """The module's forward equals rms_norm_ref on probes (a CPU copy of its weight)."""
    weight = module.weight.detach().to("cpu")
    twin = types.SimpleNamespace(**{k: v for k, v in vars(module).items() if not k.startswith("_")})
    for dtype in _PROBE_DTYPES:
        x = _probe((3, weight.shape[0]), dtype, seed=1)
        w = weight.to(dtype) if weight.is_floating_point() else weight
        twin.weight = w
        try:
            original = type(module).forward(twin, x)
        except Exception:  # a forward that needs more than its attributes is not the formula we know
            return False
        if not _same(original, rms_norm_ref(x, w, eps)):
            return False
    return True


def fuse_rms_norms(model: nn.Module) -> int:
    """Give every RMSNorm that computes ``w * rms_normalise(x)`` the fused op; returns how many."""
    fused = 0
    checked: dict[tuple[type, float], bool] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        eps = _rms_epsilon(module)
        if not type(module).__name__.endswith("RMSNorm") or eps is None:
            continue
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or getattr(module, "bias", None) is not None:
            continue
        key = (type(module), eps)
        if key not in checked:
            checked[key] = _computes_rms_norm(module, eps)
        if checked[key]:
            module.oscar_eps = eps
            module.forward = types.MethodType(_fused_rms_forward, module)
            fused += 1
    return fused


# ------------------------------------------------------------------ gated MLPs
def _fused_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(torch.ops.oscar.silu_mul(self.gate_proj(x), self.up_proj(x)))


def _merged_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate_up = F.linear(x, self.oscar_gate_up_weight)  # merge_projections: [gate | up] in one GEMM
    width = self.gate_proj.out_features
    return self.down_proj(torch.ops.oscar.silu_mul(gate_up[..., :width], gate_up[..., width:]))


def _is_silu(act: Callable) -> bool:
    for dtype in _PROBE_DTYPES:
        x = _probe((4, 64), dtype, seed=2)
        try:
            if not _same(act(x), F.silu(x)):
                return False
        except Exception:
            return False
    return True


def fuse_gated_mlps(model: nn.Module) -> tuple[int, int]:
    """MLPs computing ``down(silu(gate(x)) * up(x))`` get ``oscar::silu_mul``, and where the
    weights allow, one GEMM for gate and up (merge_projections); returns (fused, merged) counts."""
    fused = merged = 0
    standard: dict[type, bool] = {}
    for module in model.modules():
        parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(p, nn.Linear) for p in parts) or not callable(getattr(module, "act_fn", None)):
            continue
        if type(module) not in standard:
            standard[type(module)] = _standard_mlp(type(module))
        if standard[type(module)] and _is_silu(module.act_fn):
            one_gemm = merge_gate_up(module)
            module.forward = types.MethodType(_merged_mlp_forward if one_gemm else _fused_mlp_forward, module)
            fused, merged = fused + 1, merged + one_gemm
    return fused, merged


_SHIFTS = {"gate_proj": 1.0, "up_proj": 2.0, "down_proj": 3.0}


def _standard_mlp(cls: type) -> bool:
    """The class's forward is down(act(gate(x)) * up(x)): checked with stand-in projections that
    shift their input by different amounts, so any other wiring changes the result."""
    twin = types.SimpleNamespace(**{name: (lambda x, shift=shift: x + shift) for name, shift in _SHIFTS.items()})
    twin.act_fn = torch.sigmoid
    x = _probe((2, 8), torch.float32, seed=3)
    try:
        out = cls.forward(twin, x)
    except Exception:
        return False
    expected = torch.sigmoid(x + _SHIFTS["gate_proj"]) * (x + _SHIFTS["up_proj"]) + _SHIFTS["down_proj"]
    return isinstance(out, torch.Tensor) and _same(out, expected)


# ------------------------------------------------------------------ RoPE in a traced attention graph
def _rope_matches(rope_fn: Callable) -> bool:
    """``rope_fn(q, k, cos, sin)`` equals rope_ref on probes (values; the layouts differ)."""
    for dtype in _PROBE_DTYPES:
        q, k = _probe((1, 4, 3, 32), dtype, seed=4), _probe((1, 2, 3, 32), dtype, seed=5)
        cos, sin = _probe((1, 3, 32), dtype, seed=6), _probe((1, 3, 32), dtype, seed=7)
        try:
            got = rope_fn(q, k, cos, sin)
        except Exception:
            return False
        want = rope_ref(q, k, cos, sin)
        if not (isinstance(got, tuple) and len(got) == 2 and all(_same(g, w) for g, w in zip(got, want, strict=True))):
            return False
    return True


def fuse_rope(graph: torch.fx.Graph, site: AttentionSite, rotate: bool, has_mean: bool) -> bool:
    """Replace ``apply_rotary_pos_emb(q, k, cos, sin)``, and with ``rotate`` the key / query rotation
    by the module buffers ``oscar_rot_k`` (``oscar_k_mean``), by one ``oscar::rope`` node. False,
    and the graph untouched, when the traced RoPE is not the rotate-half formula."""
    rope = site.rope
    if len(rope.args) != 4 or rope.kwargs or not _rope_matches(rope.target):
        return False
    with graph.inserting_before(rope):
        rot = graph.get_attr("oscar_rot_k") if rotate else None
        mean = graph.get_attr("oscar_k_mean") if has_mean else None
        q, k, cos, sin = rope.args  # apply_rotary_pos_emb's
        fused = graph.call_function(op_of(RopeArgs), tuple(RopeArgs(q=q, k=k, cos=cos, sin=sin, rot=rot, mean=mean)))
    rope.replace_all_uses_with(fused)
    graph.erase_node(rope)
    site.rope = fused
    return True
