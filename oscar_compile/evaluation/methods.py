"""The methods compared side by side: compression specs (YAML files, shipped or built-in names)
and the KIVI-style baseline, with their honest bits per element.

A method name given to ``--specs`` resolves, in order, to: an existing ``.yaml``/``.yml`` file
(the method is named after its stem); ``kivi-int2`` / ``kivi-int4`` with optional ``-g<G>`` and
``-r<R>`` (kivi.py); a built-in variant below; a shipped spec (``oscar_compile/specs``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..quant import bits_per_element
from ..spec import CompressionSpec, shipped_spec, specs_dir
from .kivi import KiviConfig, kivi_bits_per_element, parse_kivi_name
from .names import DEFAULT_METHODS


def _variant(base: str, **sections: dict) -> Callable[[], CompressionSpec]:
    """A shipped spec with some fields of its key / value sections replaced."""

    def make() -> CompressionSpec:
        spec = shipped_spec(base)
        data = spec.model_dump(mode="json")
        for section, changes in sections.items():
            data[section].update(changes)
        return CompressionSpec.from_dict(data, source=f"built-in variant of {base}")

    return make


BUILTIN_VARIANTS: dict[str, tuple[Callable[[], CompressionSpec], str]] = {
    "oscar-int2-per-head": (
        _variant("oscar-int2", key={"granularity": "per_head"}, value={"granularity": "per_head"}),
        "oscar-int2 with one key and one value rotation per KV head",
    ),
    "oscar-int2-attn-output": (
        _variant("oscar-int2", value={"target": "attention_output"}),
        "oscar-int2 with the attention-output value target (C_S) instead of score-weighted",
    ),
}



@dataclass(frozen=True)
class Method:
    """One column of the comparison: a spec, or the KIVI baseline (``spec`` None)."""

    name: str
    source: str  # a file path, "shipped", "built-in"
    spec: CompressionSpec | None = None
    kivi: KiviConfig | None = None
    description: str = ""

    @property
    def is_reference(self) -> bool:
        """No quantized layer at all: the BF16 baseline every other method is compared with."""
        return self.spec is not None and self.spec.kv_cache.bits == 16 and not self.spec.layers

    def bits_per_element(self, head_dim: int, num_layers: int, context: int | None) -> float:
        """Average stored bits per K/V element over layers at ``context`` tokens (None: asymptotic)."""
        if self.kivi is not None:
            return kivi_bits_per_element(self.kivi, context)
        per_layer = []
        for i in range(num_layers):
            kv = self.spec.for_layer(i, num_layers).kv_cache
            per_layer.append(bits_per_element(head_dim, kv.bits, kv.group_size, kv.scale_dtype,
                                              context, kv.sink_tokens, kv.recent_tokens))
        return sum(per_layer) / len(per_layer)


def _describe(spec: CompressionSpec) -> str:
    kv, k, v = spec.kv_cache, spec.key, spec.value
    if kv.bits == 16:
        return "no compression"
    text = (f"INT{kv.bits} G{kv.group_size} S0={kv.sink_tokens} W={kv.recent_tokens}; "
            f"K {k.rotation}/{k.granularity} clip {k.clip_ratio}{' centred' if k.center else ''}; "
            f"V {v.rotation}/{v.granularity} clip {v.clip_ratio}")
    return text + (f" {v.target}" if v.rotation in ("oscar", "optr") else "")


def resolve_method(name: str) -> Method:
    """Turn one ``--specs`` entry into a :class:`Method` (see the module docstring for the order)."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise FileNotFoundError(f"no spec file at {path}")
        spec = CompressionSpec.from_yaml(path)
        return Method(path.stem, str(path), spec=spec, description=_describe(spec))
    kivi = parse_kivi_name(name)
    if kivi is not None:
        return Method(name, "built-in", kivi=kivi, description=(
            f"KIVI-style INT{kivi.bits}: keys per channel over {kivi.group_size}-token groups, values per token "
            f"in {kivi.group_size}-channel groups, {kivi.residual} recent tokens full precision, no sink"))
    if name in BUILTIN_VARIANTS:
        make, text = BUILTIN_VARIANTS[name]
        spec = make()
        return Method(name, "built-in", spec=spec, description=f"{text}: {_describe(spec)}")
    try:
        spec = shipped_spec(name)
    except FileNotFoundError:
        raise ValueError(f"unknown method {name!r}: give a spec .yaml file, kivi-int2[-g<G>][-r<R>], "
                         f"a built-in ({', '.join(BUILTIN_VARIANTS)}) or a shipped spec "
                         f"({', '.join(sorted(p.stem for p in specs_dir().glob('*.yaml')))})") from None
    return Method(name, "shipped", spec=spec, description=_describe(spec))


def resolve_methods(names: Sequence[str]) -> list[Method]:
    """Resolve every name; refuse duplicates (results are keyed by method name)."""
    methods = [resolve_method(n) for n in names]
    seen: dict[str, str] = {}
    for m, n in zip(methods, names, strict=True):
        if m.name in seen:
            raise ValueError(f"two methods are named {m.name!r} ({seen[m.name]} and {n}); rename one file")
        seen[m.name] = n
    if not methods:
        raise ValueError("no methods to compare")
    return methods


__all__ = ["BUILTIN_VARIANTS", "DEFAULT_METHODS", "Method", "resolve_method", "resolve_methods"]
