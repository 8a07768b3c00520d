import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from oscar_compile import ArtifactError, CompressionSpec, Rotations, calibrate
from oscar_compile.architectures import ModelFingerprint
from oscar_compile.artifact import export_reference, import_reference
from oscar_compile.testing import tiny_model

SPEC = CompressionSpec.from_dict({"kv_cache": {"group_size": 16}, "key": {"center": True}})


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def rot(model):
    return calibrate(model, SPEC, [torch.randint(0, 128, (2, 24))])


def _read(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_round_trip(tmp_path, model, rot):
    path = tmp_path / "rot.safetensors"
    rot.save(path)
    back = Rotations.load(path, model)
    assert back.spec == rot.spec and back.fingerprint == rot.fingerprint and back.num_tokens == rot.num_tokens
    for i in range(2):
        assert torch.equal(back.k[i], rot.k[i]) and torch.equal(back.v[i], rot.v[i])
        assert torch.equal(back.k_mean[i], rot.k_mean[i])
    tensors, meta = _read(path)
    assert tensors["layers.0.k"].shape == (2, 16, 16) and tensors["layers.0.k_mean"].shape == (2, 16)
    assert meta["format_version"] == "1" and json.loads(meta["fingerprint"])["head_dim"] == 16
    assert "library_version" in meta and json.loads(meta["spec"])["key"]["center"] is True


def test_tampered_rotation_is_refused(tmp_path, rot):
    path = tmp_path / "rot.safetensors"
    rot.save(path)
    tensors, meta = _read(path)
    tensors["layers.1.v"][0, 0, 0] += 0.01
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ArtifactError, match=r"layers.1.v is not orthogonal"):
        Rotations.load(path)


def test_wrong_shapes_and_missing_tensors_are_refused(tmp_path, rot):
    path = tmp_path / "rot.safetensors"
    rot.save(path)
    tensors, meta = _read(path)
    del tensors["layers.1.k"]
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ArtifactError, match="missing tensor"):
        Rotations.load(path)
    tensors, meta = _read(path)
    tensors["layers.1.k"] = torch.eye(8).expand(2, 8, 8).clone()
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ArtifactError, match=r"shape \(2, 8, 8\), expected \(2, 16, 16\)"):
        Rotations.load(path)


def test_not_an_artifact(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(1)}, str(path), metadata={"format": "other"})
    with pytest.raises(ArtifactError, match="not an oscar_compile rotation file"):
        Rotations.load(path)
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ArtifactError, match="not a readable"):
        Rotations.load(tmp_path / "junk.safetensors")


def test_mismatched_model_is_refused_with_the_difference(tmp_path, rot):
    path = tmp_path / "rot.safetensors"
    rot.save(path)
    other = tiny_model("qwen3", num_heads=4, num_kv_heads=4, head_dim=16)
    with pytest.raises(ArtifactError, match="num_kv_heads: artifact has 2, model has 4"):
        Rotations.load(path, other)
    llama = tiny_model("llama", num_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(ArtifactError, match="architecture"):
        Rotations.load(path, llama)


@pytest.mark.parametrize("granularity", ["per_layer", "per_head"])
def test_reference_format_export_and_import(tmp_path, model, granularity):
    spec = CompressionSpec.from_dict({"kv_cache": {"group_size": 16}, "key": {"granularity": granularity},
                                      "value": {"granularity": granularity}})
    rot = calibrate(model, spec, [torch.randint(0, 128, (2, 24))])
    export_reference(rot, tmp_path / "k.pt", tmp_path / "v.pt")
    payload = torch.load(tmp_path / "k.pt", weights_only=True)
    # per-layer rotations: the release's version 1; per-head ones: its rotation zoo's version 2
    version = 1 if granularity == "per_layer" else 2
    assert payload["objective"] == "qqt" and payload["format_version"] == version
    assert payload["source_grouping"] == ("layer" if version == 1 else "kv_head")
    assert payload["layers"][0]["rotation"].shape == ((16, 16) if granularity == "per_layer" else (2, 16, 16))
    back = import_reference(tmp_path / "k.pt", tmp_path / "v.pt", ModelFingerprint.of(model), spec)
    for i in range(2):
        assert torch.equal(back.k[i], rot.k[i]) and torch.equal(back.v[i], rot.v[i])
        assert torch.equal(back.extra(i, "k_eigenvalues"), rot.extra(i, "k_eigenvalues"))


def test_reference_file_with_wrong_layers_is_refused(tmp_path, model):
    torch.save({"format_version": 1, "objective": "qqt", "layers": {0: {"rotation": torch.eye(16)}}}, tmp_path / "k.pt")
    with pytest.raises(ArtifactError, match="the model has 2"):
        import_reference(tmp_path / "k.pt", tmp_path / "k.pt", ModelFingerprint.of(model), SPEC)


def test_reference_format_version_2_of_per_layer_rotations_round_trips(tmp_path, rot, model):
    export_reference(rot, tmp_path / "k.pt", tmp_path / "v.pt", format_version=2)
    payload = torch.load(tmp_path / "v.pt", weights_only=True)
    assert payload["format_version"] == 2 and payload["layers"][1]["rotation"].shape == (2, 16, 16)
    back = import_reference(tmp_path / "k.pt", tmp_path / "v.pt", ModelFingerprint.of(model), SPEC)
    for i in range(2):
        assert torch.equal(back.k[i], rot.k[i]) and torch.equal(back.v[i], rot.v[i])


def test_reference_format_version_1_cannot_hold_per_head_rotations(tmp_path, model):
    spec = CompressionSpec.from_dict({"kv_cache": {"group_size": 16}, "key": {"granularity": "per_head"}})
    rot = calibrate(model, spec, [torch.randint(0, 128, (2, 24))])
    with pytest.raises(ArtifactError, match="format_version 2"):
        export_reference(rot, tmp_path / "k.pt", tmp_path / "v.pt", format_version=1)


@pytest.mark.parametrize("payload, message", [
    ({"format_version": 3, "layers": {}}, "format_version 3"),
    ({"format_version": 2, "layers": {0: {"rotation": torch.eye(16)}, 1: {"rotation": torch.eye(16)}}},
     r"expected \[H_kv, D, D\]"),
])
def test_reference_files_of_unknown_versions_or_shapes_are_refused(tmp_path, model, payload, message):
    torch.save(payload, tmp_path / "k.pt")
    with pytest.raises(ArtifactError, match=message):
        import_reference(tmp_path / "k.pt", tmp_path / "k.pt", ModelFingerprint.of(model), SPEC)
