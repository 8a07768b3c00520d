"""Which Hugging Face causal LMs we know, where their attention lives, and the model fingerprint.

The table is keyed by the HF model class name: a model we have not checked is refused rather
than rewritten on a guess. Every listed family computes attention the same way (q/k/v/o
projections, optional q/k norms before RoPE, RoPE, an ``ALL_ATTENTION_FUNCTIONS`` call), which
is what the capture and the graph passes rely on.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from torch import nn


@dataclass(frozen=True)
class ArchitectureInfo:
    layers_path: str = "model.layers"  # attribute path to the decoder layer list
    attention_attr: str = "self_attn"  # attribute of a decoder layer holding the attention module
    has_qk_norm: bool = False


ARCHITECTURES: dict[str, ArchitectureInfo] = {
    "Qwen3ForCausalLM": ArchitectureInfo(has_qk_norm=True),
    "Qwen2ForCausalLM": ArchitectureInfo(),
    "LlamaForCausalLM": ArchitectureInfo(),
    "MistralForCausalLM": ArchitectureInfo(),
}


class UnsupportedArchitecture(NotImplementedError):
    pass


def architecture_of(model: nn.Module) -> ArchitectureInfo:
    name = type(model).__name__
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise UnsupportedArchitecture(
            f"oscar_compile does not know the architecture {name!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None


def _get_path(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers, in order."""
    return list(_get_path(model, architecture_of(model).layers_path))


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention module of every decoder layer, in layer order."""
    attr = architecture_of(model).attention_attr
    return [getattr(layer, attr) for layer in decoder_layers(model)]


@dataclass(frozen=True)
class ModelFingerprint:
    """What a rotation artifact must agree with to be applied to a model."""

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model) -> ModelFingerprint:
        """The fingerprint of a loaded model, or of a Hugging Face config (before loading weights)."""
        if isinstance(model, nn.Module):
            cfg, architecture = model.config, type(model).__name__
        else:
            cfg = model
            architecture = (getattr(cfg, "architectures", None) or [type(cfg).__name__])[0]
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        return cls(
            architecture=architecture,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
        )

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelFingerprint:
        return cls(**json.loads(text))

    def differences(self, other: ModelFingerprint) -> list[str]:
        """Human-readable list of the fields that differ (empty when they match)."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{k}: artifact has {mine[k]!r}, model has {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]
