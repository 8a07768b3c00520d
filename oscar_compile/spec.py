"""The compression spec: the YAML file users write, validated strictly.

A typo must fail loudly, naming the field path and what is allowed, so every model forbids
unknown keys and every choice is a ``Literal``. The spec travels inside each rotation artifact
(as JSON), so a rotation file says how it was made.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Bits = Literal[2, 4, 16]
RotationMethod = Literal["none", "hadamard", "oscar", "optr"]
Granularity = Literal["per_layer", "per_head"]
ValueTarget = Literal["score_weighted", "attention_output"]
ScaleDType = Literal["float16", "bfloat16", "float32"]


class SpecError(ValueError):
    """A spec that does not validate; the message lists every bad field by its path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class KVCacheSpec(_Strict):
    bits: Bits = 2
    group_size: int = Field(128, ge=1, le=1024, description="channels per scale/zero group along head_dim")
    scale_dtype: ScaleDType = "float16"
    sink_tokens: int = Field(64, ge=0, description="first tokens kept in full precision")
    recent_tokens: int = Field(256, ge=0, description="most recent tokens kept in full precision")
    page_size: int = Field(16, ge=1, le=1024, description="tokens per cache page")

    @model_validator(mode="after")
    def _windows_fill_pages(self) -> KVCacheSpec:
        for name in ("sink_tokens", "recent_tokens"):
            if getattr(self, name) % self.page_size:
                raise ValueError(
                    f"{name} ({getattr(self, name)}) must be a multiple of page_size ({self.page_size})"
                )
        return self


class KeySpec(_Strict):
    rotation: RotationMethod = "oscar"
    granularity: Granularity = "per_layer"
    clip_ratio: float = Field(0.96, gt=0.0, le=1.0, description="per-token clip quantile; 1 = no clip")
    center: bool = False


class ValueSpec(_Strict):
    rotation: RotationMethod = "oscar"
    granularity: Granularity = "per_layer"
    clip_ratio: float = Field(0.92, gt=0.0, le=1.0, description="per-token clip quantile; 1 = no clip")
    target: ValueTarget = "score_weighted"


class CalibrationSpec(_Strict):
    num_tokens: int = Field(8192, ge=1, description="calibration tokens to read")
    seq_len: int = Field(2048, ge=2, description="tokens per calibration sequence")
    batch_size: int = Field(1, ge=1, description="sequences per forward pass")


class OptRSpec(_Strict):
    """OptR refinement (rotation: optr): per-head corrections learned against the post-W_O error."""

    steps: int = Field(80, ge=1, description="Adam steps per layer and phase (keys, then values)")
    lr: float = Field(0.02, gt=0.0)
    lambda_k: float = Field(1.0, ge=0.0, description="weight of the post-W_O error in the key loss")
    num_queries: int = Field(64, ge=1, description="last query positions of each sequence in the loss")
    eval_every: int = Field(20, ge=1, description="held-out check interval; the best check is kept")
    heldout_fraction: float = Field(0.5, gt=0.0, lt=1.0, description="calibration sequences held out for selection")


# Overrides name a subset of fields; unset ones fall back to the top-level section.
class KVCacheOverride(_Strict):
    bits: Bits | None = None
    group_size: int | None = Field(None, ge=1, le=1024)
    scale_dtype: ScaleDType | None = None
    sink_tokens: int | None = Field(None, ge=0)
    recent_tokens: int | None = Field(None, ge=0)


class KeyOverride(_Strict):
    rotation: RotationMethod | None = None
    granularity: Granularity | None = None
    clip_ratio: float | None = Field(None, gt=0.0, le=1.0)
    center: bool | None = None


class ValueOverride(_Strict):
    rotation: RotationMethod | None = None
    granularity: Granularity | None = None
    clip_ratio: float | None = Field(None, gt=0.0, le=1.0)
    target: ValueTarget | None = None


class LayerOverride(_Strict):
    match: list[int] = Field(description="layer indices; negative counts from the last layer")
    kv_cache: KVCacheOverride | None = None
    key: KeyOverride | None = None
    value: ValueOverride | None = None


class LayerSpec(_Strict):
    """The settings of one layer after the overrides are resolved."""

    index: int
    kv_cache: KVCacheSpec
    key: KeySpec
    value: ValueSpec
    overridden_to_16_bits: bool = False

    @property
    def quantized(self) -> bool:
        return self.kv_cache.bits != 16


def _merge(base: BaseModel, override: BaseModel | None) -> BaseModel:
    if override is None:
        return base
    changes = {k: v for k, v in override.model_dump().items() if v is not None}
    return type(base).model_validate({**base.model_dump(), **changes})


class CompressionSpec(_Strict):
    """What to do to a model's KV cache (see specs/*.yaml and README "Spec reference")."""

    version: Literal[1] = 1
    kv_cache: KVCacheSpec = KVCacheSpec()
    key: KeySpec = KeySpec()
    value: ValueSpec = ValueSpec()
    calibration: CalibrationSpec = CalibrationSpec()
    optr: OptRSpec = OptRSpec()
    layers: list[LayerOverride] = []

    @model_validator(mode="after")
    def _overrides_resolve(self) -> CompressionSpec:
        for i, override in enumerate(self.layers):
            try:
                _merge(self.kv_cache, override.kv_cache)
            except ValidationError as err:
                raise ValueError(f"layers[{i}].kv_cache does not combine with kv_cache: "
                                 f"{err.errors()[0]['msg']}") from None
        return self

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any, source: str = "spec") -> CompressionSpec:
        if not isinstance(data, dict):
            raise SpecError(f"{source}: the spec must be a mapping at the top level, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise SpecError(_format_errors(err, source)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> CompressionSpec:
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise SpecError(f"{path}: not valid YAML: {err}") from None
        return cls.from_dict(data if data is not None else {}, source=str(path))

    @classmethod
    def from_json(cls, text: str) -> CompressionSpec:
        return cls.from_dict(json.loads(text), source="json")

    def to_json(self) -> str:
        return self.model_dump_json()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    @classmethod
    def json_schema(cls) -> dict:
        return cls.model_json_schema()

    # -- resolution ------------------------------------------------------------------------
    def for_layer(self, index: int, num_layers: int) -> LayerSpec:
        """The resolved settings of layer ``index``; later overrides win over earlier ones."""
        kv, key, value = self.kv_cache, self.key, self.value
        overridden_16 = False
        for override in self.layers:
            if any(_resolve_index(m, num_layers) == index for m in override.match):
                kv, key, value = _merge(kv, override.kv_cache), _merge(key, override.key), _merge(value, override.value)
                if override.kv_cache is not None and override.kv_cache.bits is not None:
                    overridden_16 = override.kv_cache.bits == 16
        return LayerSpec(index=index, kv_cache=kv, key=key, value=value, overridden_to_16_bits=overridden_16)

    def check_layers(self, num_layers: int) -> None:
        """Refuse overrides that name layers the model does not have."""
        for i, override in enumerate(self.layers):
            for m in override.match:
                if not -num_layers <= m < num_layers:
                    raise SpecError(f"layers[{i}].match: layer {m} out of range for a model of {num_layers} layers")


def _resolve_index(m: int, num_layers: int) -> int:
    return m + num_layers if m < 0 else m


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid compression spec"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = f"unknown field; allowed: {', '.join(_allowed_fields(e['loc'][:-1]))}"
        lines.append(f"  {path}: {msg} (got {e.get('input')!r})")
    return "\n".join(lines)


def _allowed_fields(loc: tuple) -> list[str]:
    """The field names valid at ``loc`` (a pydantic error location), for "unknown field" errors."""
    model: Any = CompressionSpec
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        ann = field.annotation
        for candidate in (ann, *getattr(ann, "__args__", ())):
            is_list = getattr(candidate, "__origin__", None) is list
            inner = getattr(candidate, "__args__", (candidate,))[0] if is_list else candidate
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                model = inner
                break
        else:
            return []
    return sorted(model.model_fields)


def specs_dir() -> Path:
    """The folder of shipped specs (``specs/`` in the repo, ``oscar_compile/specs`` when installed)."""
    return Path(__file__).resolve().parent / "specs"


def shipped_spec(name: str) -> CompressionSpec:
    """Load a shipped spec by name, e.g. ``shipped_spec("oscar-int2")``."""
    path = specs_dir() / f"{name.removesuffix('.yaml')}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in specs_dir().glob("*.yaml"))
        raise FileNotFoundError(f"no shipped spec {name!r}; available: {', '.join(names)}")
    return CompressionSpec.from_yaml(path)
