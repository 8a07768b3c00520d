"""The formats a layer's history may take in a mixed-precision spec, and the spec they make.

A format is a ``layers[]`` override on top of the base spec (``{}``: the base format itself)
with its honest cost in bits per cached row of ``head_dim`` elements: codes plus scale and zero
per group, the eval report's asymptotic bits per element times ``head_dim`` (the windows are a
fixed cost a long context amortises). INT4 layers take the clip ratios of the shipped INT4
recipe (``specs/oscar-int4.yaml``): clipping 4-8 % of each token's channels is right for INT2,
whose rounding error is large, and a loss at INT4, whose rounding error is small.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import yaml

from ..quant import bits_per_element
from ..spec import CompressionSpec, KVCacheSpec, LayerSpec, shipped_spec
from ..spec_fit import FittedSpec, fit_spec

UPGRADE_BITS = (4, 16)


@dataclass(frozen=True)
class Format:
    """One way to store a layer: its name, bits, group size, cost and the override that selects it."""

    name: str
    bits: int
    group_size: int
    cost: int  # stored bits per K/V row of head_dim elements
    override: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def is_base(self) -> bool:
        return not self.override


def row_bits(head_dim: int, kv: KVCacheSpec) -> int:
    """Stored bits of one K or V row: ``head_dim * bits`` plus a scale and a zero per group.

    The asymptotic bits per element of the eval report (quant.bits_per_element) times head_dim,
    a whole number when the groups divide head_dim (rounded off float error only).
    """
    return round(bits_per_element(head_dim, kv.bits, kv.group_size, kv.scale_dtype) * head_dim)


def _name(kv: KVCacheSpec) -> str:
    return "bf16" if kv.bits == 16 else f"int{kv.bits}-g{kv.group_size}"


def layer_formats(spec: FittedSpec, index: int, head_dim: int, num_layers: int,
                  upgrade_bits: Sequence[int] = UPGRADE_BITS, group_sizes: Sequence[int] = ()) -> list[Format]:
    """The base format of layer ``index`` first, then every format with more bits or smaller groups.

    ``spec``: fitted to the model (``sweep.plan`` fits it). ``group_sizes``: extra group sizes at
    the base bits (each must divide ``head_dim``), e.g. 64 and 32 for INT2 at 2.5 and 3.0 bits
    per element with fp16 scale and zero.
    """
    base = spec.for_layer(index, num_layers)
    kv = base.kv_cache
    out = [Format(_name(kv), kv.bits, kv.group_size, row_bits(head_dim, kv))]
    if kv.bits == 16:
        return out
    for g in sorted(set(group_sizes), reverse=True):
        if g < kv.group_size:
            if head_dim % g:
                raise ValueError(f"group size {g} does not divide head_dim {head_dim}")
            alt = kv.model_copy(update={"group_size": g})
            out.append(Format(_name(alt), kv.bits, g, row_bits(head_dim, alt), {"kv_cache": {"group_size": g}}))
    for bits in sorted(set(upgrade_bits)):
        if bits <= kv.bits:
            continue
        alt = kv.model_copy(update={"bits": bits})
        override: dict = {"kv_cache": {"bits": bits}}
        if bits == 4:
            int4 = shipped_spec("oscar-int4")
            override.update(key={"clip_ratio": int4.key.clip_ratio}, value={"clip_ratio": int4.value.clip_ratio})
        out.append(Format(_name(alt), bits, kv.group_size, row_bits(head_dim, alt), override))
    return out


def with_formats(base: CompressionSpec, chosen: dict[int, Format]) -> CompressionSpec:
    """``base`` plus one override per distinct non-base format, naming the layers that take it.

    Appended after the base spec's own overrides, so they win (later overrides win). A new spec:
    fitted here, to the model ``base`` was fitted to, when ``base`` is a :class:`FittedSpec`.
    """
    data = base.model_dump(mode="json", exclude_none=True)
    # keyed by the override itself, not the format's name: two layers whose base formats differ
    # can reach formats of one name through different overrides
    groups: dict[str, list[int]] = {}
    overrides: dict[str, dict] = {}
    for index in sorted(chosen):
        fmt = chosen[index]
        if not fmt.is_base:
            key = json.dumps(fmt.override, sort_keys=True)
            groups.setdefault(key, []).append(index)
            overrides[key] = fmt.override
    data["layers"] = data.get("layers", []) + [{"match": groups[key], **overrides[key]} for key in groups]
    mixed = CompressionSpec.from_dict(data, source="mixed-precision spec")
    if isinstance(base, FittedSpec):
        facts = base.fitted_to
        return fit_spec(mixed, facts.head_dim, facts.num_layers, facts.model)
    return mixed


def with_format(base: CompressionSpec, index: int, fmt: Format) -> CompressionSpec:
    """``base`` with layer ``index`` alone stored as ``fmt`` (a probe of the sweep)."""
    return with_formats(base, {index: fmt})


def spec_yaml(spec: CompressionSpec, header: Sequence[str] = ()) -> str:
    """The spec as the YAML style of ``specs/*.yaml`` (leaf sections in flow style), comment lines first."""
    body = yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True), sort_keys=False, default_flow_style=None,
                          width=120)
    return "".join(f"# {line}\n" if line else "#\n" for line in header) + body


def resolved_layers(spec: FittedSpec, num_layers: int) -> list[LayerSpec]:
    return [spec.for_layer(i, num_layers) for i in range(num_layers)]


__all__ = ["Format", "UPGRADE_BITS", "layer_formats", "resolved_layers", "row_bits", "spec_yaml", "with_format",
           "with_formats"]
