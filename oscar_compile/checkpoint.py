"""A self-contained compressed checkpoint: one Hugging Face directory that serves with no other flags.

``save_compressed(model, spec, rotations, out_dir)`` writes
- the weights with R_V folded into ``v_proj`` / ``o_proj`` (safetensors, sharded as the model's
  source checkpoint was: same files, same tensors in each; the dtype the model is loaded in, so
  the folded weights are exactly those ``apply`` computes);
- ``config.json`` with a metadata block under ``"oscar_compression"`` (in the spirit of the
  ``quantization_config`` that llm-compressor / compressed-tensors write): format, format version,
  library version, the spec, the model fingerprint, the rotation file's name and SHA-256;
- the rotation artifact (``oscar_rotations.safetensors``: key rotations and means, what ``apply``
  still needs at run time; the value rotations ride along for re-export), the generation config
  and the tokenizer.

``load_compressed(dir)`` returns the model with ``apply`` done (values not folded twice). It
reads safetensors and JSON only (never a pickle) and checks the format version, the rotation
file's hash, its fingerprint against the loaded model, and its orthogonality, with clear errors.
A plain Hugging Face directory is not a compressed checkpoint (``compression_of`` gives None) and
loads as before.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ._version import __version__
from .architectures import ModelFingerprint, attention_modules
from .artifact import COMPRESSED_CONFIG_KEY, ArtifactError, Rotations
from .passes.fold_values import folded_value_weights
from .spec import CompressionSpec
from .spec_fit import fit_spec_to_model

logger = logging.getLogger(__name__)

FORMAT = "oscar_compile.compressed"
FORMAT_VERSION = 1
ROTATIONS_FILE = "oscar_rotations.safetensors"
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "tokenizer.model", "chat_template.jinja", "added_tokens.json")


@dataclass(frozen=True)
class Compression:
    """What a compressed checkpoint's ``config.json`` block says (read by :func:`compression_of`)."""

    model_dir: Path
    spec: CompressionSpec
    fingerprint: ModelFingerprint
    rotations_path: Path
    rotations_sha256: str
    library_version: str
    dtype: str | None  # the dtype the weights were written in (config.json's)

    def load_rotations(self, model: torch.nn.Module | None = None) -> Rotations:
        """The rotation file, hash-checked, then checked by :meth:`Rotations.load` (orthogonality,
        shapes and, with ``model``, the fingerprint)."""
        if not self.rotations_path.is_file():
            raise ArtifactError(f"{self.model_dir}: the compressed checkpoint has no {self.rotations_path.name}")
        digest = _sha256(self.rotations_path)
        if digest != self.rotations_sha256:
            raise ArtifactError(f"{self.rotations_path}: SHA-256 {digest[:12]}... differs from the "
                                f"{self.rotations_sha256[:12]}... config.json names: the file was replaced or edited")
        rotations = Rotations.load(self.rotations_path, model)
        if rotations.fingerprint != self.fingerprint:
            raise ArtifactError(f"{self.rotations_path}: its fingerprint differs from config.json's:\n  "
                                + "\n  ".join(self.fingerprint.differences(rotations.fingerprint)))
        return rotations


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def compression_of(model_dir: str | Path) -> Compression | None:
    """The compression block of ``model_dir/config.json``; None for a plain Hugging Face directory."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no config.json in {model_dir}: expected a Hugging Face model directory") from None
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{config_path}: not valid JSON ({err})") from None
    block = config.get(COMPRESSED_CONFIG_KEY)
    if block is None:
        return None
    if not isinstance(block, dict) or block.get("format") != FORMAT:
        raise ArtifactError(f"{config_path}: {COMPRESSED_CONFIG_KEY!r} is not an {FORMAT} block")
    if block.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{config_path}: compressed checkpoint format version {block.get('format_version')!r}, "
                            f"this library (oscar_compile {__version__}) reads {FORMAT_VERSION}")
    if not ((model_dir / _INDEX).is_file() or (model_dir / _SINGLE).is_file()):
        raise ArtifactError(f"{model_dir}: a compressed checkpoint keeps its weights in safetensors, "
                            "and none are there")
    if block.get("values_folded") is not True:
        raise ArtifactError(f"{config_path}: a compressed checkpoint holds weights with R_V folded in "
                            f"(values_folded: true), got {block.get('values_folded')!r}")
    name = block.get("rotations")
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise ArtifactError(f"{config_path}: the rotation file must be a file name inside the checkpoint, "
                            f"got {name!r}")
    try:
        return Compression(model_dir=model_dir, spec=CompressionSpec.from_dict(block["spec"], source=str(config_path)),
                           fingerprint=ModelFingerprint.from_json(json.dumps(block["fingerprint"])),
                           rotations_path=model_dir / block["rotations"], rotations_sha256=block["rotations_sha256"],
                           library_version=str(block.get("library_version", "?")),
                           dtype=config.get("dtype") or config.get("torch_dtype"))
    except (KeyError, TypeError) as err:
        raise ArtifactError(f"{config_path}: the {COMPRESSED_CONFIG_KEY!r} block is incomplete ({err})") from None


# -- writing ---------------------------------------------------------------------------------
def _folded_state_dict(model: torch.nn.Module, spec: CompressionSpec, rotations: Rotations) -> dict[str, torch.Tensor]:
    """The model's state dict with R_V folded into every rotated layer's v_proj / o_proj."""
    from .passes.apply import resolve_layers

    state = dict(model.state_dict())
    names = {id(m): n for n, m in model.named_modules()}
    fp = ModelFingerprint.of(model)
    for layer, attn in zip(resolve_layers(spec, fp.num_layers), attention_modules(model), strict=True):
        if layer.value.rotation == "none":
            continue
        prefix = names[id(attn)]
        bias = attn.v_proj.bias
        w_v, b_v, w_o = folded_value_weights(attn.v_proj.weight, bias, attn.o_proj.weight,
                                             rotations.v[layer.index], fp.num_heads)
        state[f"{prefix}.v_proj.weight"], state[f"{prefix}.o_proj.weight"] = w_v, w_o
        if b_v is not None:
            state[f"{prefix}.v_proj.bias"] = b_v
    return state


def _shard_plan(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """file name -> tensor names: the source checkpoint's sharding when the model came from one,
    else one file with every tensor that is not a tied alias of another."""
    source = Path(str(getattr(model, "name_or_path", "") or ""))
    index = source / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        plan: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            plan.setdefault(file, []).append(name)
    elif (source / _SINGLE).is_file():
        with safe_open(str(source / _SINGLE), framework="pt") as f:
            plan = {_SINGLE: list(f.keys())}
    else:
        seen, names = set(), []
        for name, t in state.items():
            key = (t.data_ptr(), t.shape, t.dtype)
            if key not in seen:
                seen.add(key)
                names.append(name)
        plan = {_SINGLE: names}
    missing = sorted({n for names in plan.values() for n in names} - set(state))
    if missing:
        raise ValueError(f"the source checkpoint of this model names tensors it does not hold: {missing[:5]}")
    return plan


def _write_weights(out_dir: Path, plan: dict[str, list[str]], state: dict[str, torch.Tensor]) -> None:
    weight_map, total = {}, 0
    for file, names in plan.items():
        tensors = {n: state[n].detach().contiguous().cpu() for n in names}
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({n: file for n in names})
    if len(plan) > 1 or _SINGLE not in plan:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / _INDEX).write_text(json.dumps(index, indent=2) + "\n")


def write_tokenizer(source_dir: str | Path | None, out_dir: Path, tokenizer=None) -> None:
    """``tokenizer.save_pretrained(out_dir)``, else a copy of the tokenizer files of ``source_dir``."""
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
        return
    source = Path(str(source_dir or ""))
    copied = [n for n in _TOKENIZER_FILES if (source / n).is_file()]
    for name in copied:
        shutil.copyfile(source / name, out_dir / name)
    if not copied:
        logger.warning("no tokenizer written: pass tokenizer= (the model's source %s has none)", source)


def save_compressed(model: torch.nn.Module, spec: CompressionSpec | str | Path,
                    rotations: Rotations | str | Path, out_dir: str | Path, tokenizer=None) -> Path:
    """Write ``model`` (as loaded, before ``apply``) compressed with ``spec`` and ``rotations`` to
    ``out_dir``, a directory ``load_compressed``, ``LLM(out_dir)`` and ``serve --model`` take as it is."""
    from .passes.apply import is_rewritten

    if is_rewritten(model):
        raise ValueError("save_compressed takes the model before apply(): its v_proj / o_proj must not hold R_V yet")
    if getattr(model.config, COMPRESSED_CONFIG_KEY, None):
        raise ValueError("this model is already a compressed checkpoint: copy its directory instead")
    if not isinstance(spec, CompressionSpec):
        spec = CompressionSpec.from_yaml(spec)
    spec = fit_spec_to_model(spec, model)
    if not isinstance(rotations, Rotations):
        rotations = Rotations.load(rotations, model)
    rotations.check_model(model)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} exists and is not empty: give a new directory")
    out_dir.mkdir(parents=True, exist_ok=True)

    state = _folded_state_dict(model, spec, rotations)
    _write_weights(out_dir, _shard_plan(model, state), state)
    rotations.save(out_dir / ROTATIONS_FILE)
    config = model.config.__class__.from_dict(model.config.to_dict())
    setattr(config, COMPRESSED_CONFIG_KEY, {
        "format": FORMAT, "format_version": FORMAT_VERSION, "library_version": __version__,
        "spec": json.loads(spec.to_json()), "fingerprint": json.loads(ModelFingerprint.of(model).to_json()),
        "rotations": ROTATIONS_FILE, "rotations_sha256": _sha256(out_dir / ROTATIONS_FILE),
        "values_folded": True,
    })
    config.dtype = model.dtype  # the folded weights are written in the dtype the model holds
    config.save_pretrained(str(out_dir))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(out_dir))
    write_tokenizer(getattr(model, "name_or_path", None), out_dir, tokenizer)
    logger.info("wrote compressed checkpoint %s (%s)", out_dir, spec.key.rotation)
    return out_dir


# -- reading ---------------------------------------------------------------------------------
def load_compressed(model_dir: str | Path, device: str = "auto", dtype=None, fuse: bool = True):
    """The model of a compressed checkpoint, with ``apply`` done: (model, tokenizer).

    ``dtype`` None loads the dtype the checkpoint was written in (its folded weights exactly).
    """
    from .loading import load_model

    compression = compression_of(model_dir)
    if compression is None:
        raise ArtifactError(f"{model_dir} is a plain Hugging Face checkpoint (no {COMPRESSED_CONFIG_KEY!r} block in "
                            "config.json): load it with transformers, or apply() a spec to it")
    model, tokenizer = load_model(model_dir, device, dtype or compression.dtype, tokenizer_required=False)
    apply_compression(model, compression, fuse=fuse)
    return model, tokenizer


def apply_compression(model: torch.nn.Module, compression: Compression, fuse: bool = True):
    """``apply`` a loaded compressed checkpoint's own spec and rotations (values already folded);
    returns the handle ``apply`` returns."""
    from .passes import apply

    rotations = compression.load_rotations(model)
    return apply(model, compression.spec, rotations, fuse=fuse, values_folded=True)


__all__ = ["save_compressed", "load_compressed", "compression_of", "apply_compression", "Compression",
           "write_tokenizer", "FORMAT", "FORMAT_VERSION", "ROTATIONS_FILE"]
