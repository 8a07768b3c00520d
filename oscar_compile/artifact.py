"""The rotation artifact: one ``.safetensors`` file with per-layer rotations and how they were made.

Tensors, per layer i (H_kv KV heads, head_dim D; a per-layer rotation is stored once per head):
  ``layers.{i}.k`` / ``layers.{i}.v``                  [H_kv, D, D] float32 orthogonal
  ``layers.{i}.k_eigenvalues`` / ``.v_eigenvalues``    [H_kv, D] (calibrated rotations only)
  ``layers.{i}.k_cov`` / ``.v_cov``                    [H_kv, D, D] the covariance targets
  ``layers.{i}.k_mean``                                [H_kv, D] post-RoPE key means
Metadata (JSON strings): format, format_version, spec, fingerprint, num_tokens, library_version.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .architectures import ModelFingerprint
from .rotation_math import orthogonality_error
from .spec import CompressionSpec

FORMAT = "oscar_compile.rotations"
FORMAT_VERSION = 1
ORTHOGONALITY_TOLERANCE = 1e-4
# the block a compressed checkpoint (oscar_compile.checkpoint) adds to config.json; apply() reads it
COMPRESSED_CONFIG_KEY = "oscar_compression"
_OPTIONAL = ("k_eigenvalues", "v_eigenvalues", "k_cov", "v_cov", "k_mean")


class ArtifactError(ValueError):
    """A rotation file that is malformed, tampered with, or made for another model."""


@dataclass
class Rotations:
    """Per-layer key and value rotations of one model, with the spec that made them."""

    spec: CompressionSpec
    fingerprint: ModelFingerprint
    k: list[torch.Tensor]  # per layer [H_kv, D, D]
    v: list[torch.Tensor]
    num_tokens: int = 0
    extras: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per layer: _OPTIONAL names

    def __post_init__(self) -> None:
        if not self.extras:
            self.extras = [{} for _ in self.k]
        self.validate()

    # -- accessors -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def k_mean(self) -> list[torch.Tensor | None]:
        return [e.get("k_mean") for e in self.extras]

    def extra(self, layer: int, name: str) -> torch.Tensor | None:
        return self.extras[layer].get(name)

    # -- checks ----------------------------------------------------------------------------
    def validate(self) -> None:
        fp = self.fingerprint
        expected = (fp.num_kv_heads, fp.head_dim, fp.head_dim)
        if not (len(self.k) == len(self.v) == len(self.extras) == fp.num_layers):
            raise ArtifactError(
                f"artifact holds {len(self.k)} key / {len(self.v)} value layers, fingerprint says {fp.num_layers}"
            )
        for i, (rk, rv) in enumerate(zip(self.k, self.v, strict=True)):
            for name, r in (("k", rk), ("v", rv)):
                if tuple(r.shape) != expected:
                    raise ArtifactError(f"layers.{i}.{name}: shape {tuple(r.shape)}, expected {expected}")
                err = orthogonality_error(r)
                if not err < ORTHOGONALITY_TOLERANCE:
                    raise ArtifactError(
                        f"layers.{i}.{name} is not orthogonal: max |R^T R - I| = {err:.2e} "
                        f"(tolerance {ORTHOGONALITY_TOLERANCE:.0e}); the file is corrupt or was edited"
                    )
            mean = self.extras[i].get("k_mean")
            if mean is not None and tuple(mean.shape) != expected[:2]:
                raise ArtifactError(f"layers.{i}.k_mean: shape {tuple(mean.shape)}, expected {expected[:2]}")

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse a model whose architecture or attention shape differs from the artifact's."""
        diffs = self.fingerprint.differences(ModelFingerprint.of(model))
        if diffs:
            raise ArtifactError("rotations were made for another model:\n  " + "\n  ".join(diffs))

    # -- I/O -------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        from ._version import __version__

        tensors = {}
        for i in range(self.num_layers):
            tensors[f"layers.{i}.k"] = self.k[i].float().contiguous().cpu()
            tensors[f"layers.{i}.v"] = self.v[i].float().contiguous().cpu()
            for name, t in self.extras[i].items():
                tensors[f"layers.{i}.{name}"] = t.float().contiguous().cpu()
        metadata = {
            "format": FORMAT,
            "format_version": str(FORMAT_VERSION),
            "spec": self.spec.to_json(),
            "fingerprint": self.fingerprint.to_json(),
            "num_tokens": str(self.num_tokens),
            "library_version": __version__,
        }
        save_file(tensors, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path, model: torch.nn.Module | None = None) -> Rotations:
        """Read and check an artifact; with ``model``, also check it was made for that model."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no rotation file at {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as err:  # safetensors raises its own error types for corrupt headers
            raise ArtifactError(f"{path}: not a readable safetensors file ({err})") from None
        if meta.get("format") != FORMAT:
            raise ArtifactError(f"{path}: not an oscar_compile rotation file (format={meta.get('format')!r})")
        if meta.get("format_version") != str(FORMAT_VERSION):
            raise ArtifactError(
                f"{path}: format version {meta.get('format_version')!r}, this library reads {FORMAT_VERSION}"
            )
        try:
            spec = CompressionSpec.from_json(meta["spec"])
            fingerprint = ModelFingerprint.from_json(meta["fingerprint"])
            num_tokens = int(meta["num_tokens"])
        except (KeyError, ValueError, TypeError) as err:
            raise ArtifactError(f"{path}: metadata is incomplete or corrupt ({err})") from None
        n = fingerprint.num_layers
        try:
            k = [tensors.pop(f"layers.{i}.k") for i in range(n)]
            v = [tensors.pop(f"layers.{i}.v") for i in range(n)]
        except KeyError as err:
            raise ArtifactError(f"{path}: missing tensor {err}") from None
        extras = [{name: tensors.pop(f"layers.{i}.{name}") for name in _OPTIONAL if f"layers.{i}.{name}" in tensors}
                  for i in range(n)]
        if tensors:
            raise ArtifactError(f"{path}: unexpected tensors {sorted(tensors)[:5]}")
        rot = cls(spec=spec, fingerprint=fingerprint, k=k, v=v, num_tokens=num_tokens, extras=extras)
        if model is not None:
            rot.check_model(model)
        return rot


# -- the OSCAR reference release's format ----------------------------------------------------
# Its rotation files are torch pickles of plain containers: {"format_version", "objective",
# "source_grouping", "layers": {i: {"layer_id", "rotation", "eigenvalues"}}}. Version 1 holds one
# [D, D] rotation per layer; version 2 (its rotation zoo's per-head files) one [H_kv, D, D] per
# layer, one rotation per KV head. Read with ``weights_only=True``: tensors and containers only.
REFERENCE_FORMAT_VERSIONS = (1, 2)


def _reference_payload(rots: list[torch.Tensor], eigvals: list[torch.Tensor | None], objective: str,
                       format_version: int) -> dict:
    layers = {}
    for i, (r, ev) in enumerate(zip(rots, eigvals, strict=True)):
        shared = format_version == 1  # checked by export_reference: every head holds the same rotation
        entry = {"layer_id": i, "rotation": (r[0] if shared else r).clone().contiguous()}
        if ev is not None:
            entry["eigenvalues"] = (ev[0] if shared else ev).clone().contiguous()
        layers[i] = entry
    grouping = "layer" if format_version == 1 else "kv_head"
    return {"format_version": format_version, "objective": objective, "source_grouping": grouping, "layers": layers}


def _heads_equal(rots: list[torch.Tensor]) -> bool:
    return all(bool((r - r[:1]).abs().max() == 0) for r in rots)


def export_reference(rot: Rotations, k_path: str | Path, v_path: str | Path,
                     format_version: int | None = None) -> None:
    """Write the key and value rotations as the reference release's two torch files.

    ``format_version``: 1 (one [D, D] per layer; refused when the KV heads of a layer differ), 2
    (the rotation zoo's per-head [H_kv, D, D] per layer), or None: 1 when every layer's heads
    share one rotation, else 2.
    """
    if format_version is None:
        format_version = 1 if _heads_equal(rot.k) and _heads_equal(rot.v) else 2
    if format_version not in REFERENCE_FORMAT_VERSIONS:
        raise ArtifactError(f"reference format_version must be one of {REFERENCE_FORMAT_VERSIONS}, "
                            f"got {format_version}")
    if format_version == 1 and not (_heads_equal(rot.k) and _heads_equal(rot.v)):
        raise ArtifactError("reference format_version 1 holds one rotation per layer, but these rotations "
                            "differ per KV head: export format_version 2")
    v_objective = "sst" if rot.spec.value.target == "score_weighted" else "attention_output"
    k_eig, v_eig = [e.get("k_eigenvalues") for e in rot.extras], [e.get("v_eigenvalues") for e in rot.extras]
    torch.save(_reference_payload(rot.k, k_eig, "qqt", format_version), str(k_path))
    torch.save(_reference_payload(rot.v, v_eig, v_objective, format_version), str(v_path))


def _read_reference(path: str | Path, fp: ModelFingerprint) -> tuple[list[torch.Tensor], list]:
    try:
        payload = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises pickle / zip errors of several types
        raise ArtifactError(f"{path}: not a readable reference rotation file ({err})") from None
    if not isinstance(payload, dict) or "layers" not in payload:
        raise ArtifactError(f"{path}: not a reference rotation file (expected a dict with 'layers')")
    version = payload.get("format_version", 1)  # the release's loader does not require the field
    if version not in REFERENCE_FORMAT_VERSIONS:
        raise ArtifactError(f"{path}: reference format_version {version!r}, this library reads "
                            f"{REFERENCE_FORMAT_VERSIONS}")
    layers = {int(k): v for k, v in payload["layers"].items()}
    if sorted(layers) != list(range(fp.num_layers)):
        raise ArtifactError(f"{path}: holds layers {sorted(layers)}, the model has {fp.num_layers}")
    per_head_shape = (fp.num_kv_heads, fp.head_dim, fp.head_dim)
    rots, eigvals = [], []
    for i in range(fp.num_layers):
        r = layers[i]["rotation"].float()
        ev = layers[i].get("eigenvalues")
        ev = None if ev is None else ev.float()
        if version == 2 and tuple(r.shape) != per_head_shape:
            raise ArtifactError(f"{path}: format_version 2 layer {i} rotation has shape {tuple(r.shape)}, "
                                f"expected [H_kv, D, D] = {per_head_shape}")
        if r.dim() == 2:  # per-layer: one [D, D] for all KV heads
            r = r.expand(fp.num_kv_heads, -1, -1).clone()
            ev = None if ev is None else ev.expand(fp.num_kv_heads, -1).clone()
        rots.append(r)
        eigvals.append(ev)
    return rots, eigvals


def import_reference(
    k_path: str | Path, v_path: str | Path, fingerprint: ModelFingerprint, spec: CompressionSpec
) -> Rotations:
    """Load the reference release's key/value rotation files (format_version 1 or 2, read with
    weights_only) into a :class:`Rotations`."""
    k, k_ev = _read_reference(k_path, fingerprint)
    v, v_ev = _read_reference(v_path, fingerprint)
    extras = []
    for kev, vev in zip(k_ev, v_ev, strict=True):
        e = {}
        if kev is not None:
            e["k_eigenvalues"] = kev
        if vev is not None:
            e["v_eigenvalues"] = vev
        extras.append(e)
    return Rotations(spec=spec, fingerprint=fingerprint, k=k, v=v, extras=extras)


__all__ = ["Rotations", "ArtifactError", "export_reference", "import_reference", "FORMAT_VERSION",
           "REFERENCE_FORMAT_VERSIONS", "COMPRESSED_CONFIG_KEY"]
