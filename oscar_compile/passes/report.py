"""What :func:`~oscar_compile.passes.apply` did, per layer and in all: a plain record that prints
as a table and that tests assert on. The live side (the model, its cache formats, the prefill
semantics of its ``generate()``) is the handle that holds it (compressed_model.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..architectures import ModelFingerprint
from ..quant import bits_per_element
from ..spec import CompressionSpec


@dataclass
class LayerReport:
    index: int
    bits: int
    key_rotation: str
    value_rotation: str
    centered: bool
    value_folded: bool
    attention: str  # the paged op: "oscar::attention" or "oscar::attention_bf16"
    notes: list[str] = field(default_factory=list)
    rope_fused: bool = False  # RoPE (and the key / query rotation) is one oscar::rope node
    qkv_merged: bool = False  # q, k, v projections are one GEMM (merge_projections)


@dataclass
class ApplyReport:
    fingerprint: ModelFingerprint
    layers: list[LayerReport]
    spec: CompressionSpec
    fused: dict[str, int] = field(default_factory=dict)  # modules / layers per fused op (apply's fuse)

    def bits_per_element(self, context: int | None = None) -> float:
        """Average stored bits per K/V element over all layers at ``context`` tokens (None: asymptotic)."""
        per_layer = []
        for i in range(len(self.layers)):
            kv = self.spec.for_layer(i, len(self.layers)).kv_cache
            per_layer.append(bits_per_element(self.fingerprint.head_dim, kv.bits, kv.group_size, kv.scale_dtype,
                                              context, kv.sink_tokens, kv.recent_tokens))
        return sum(per_layer) / len(per_layer)

    def __str__(self) -> str:
        head = f"{'layer':>5} {'bits':>4} {'key':>9} {'value':>9} {'centre':>6} {'fold':>5}  attention"
        rows = [
            f"{r.index:>5} {r.bits:>4} {r.key_rotation:>9} {r.value_rotation:>9} "
            f"{'yes' if r.centered else 'no':>6} {'yes' if r.value_folded else 'no':>5}  {r.attention}"
            + (f"  ({'; '.join(r.notes)})" if r.notes else "")
            for r in self.layers
        ]
        fused = ", ".join(f"{op} x{n}" for op, n in self.fused.items())
        return "\n".join([head, *rows] + ([f"fused ops: {fused}"] if fused else []))

