"""The compressed checkpoint: save_compressed / load_compressed, LLM(dir), serve --model dir, the CLI.

Exactness first: the logits of ``load_compressed(dir)`` equal, bit for bit, those of the model
that was saved after ``apply`` (the folded weights are written in the dtype ``apply`` folds into,
and the prompts run past sink + recent so INT2 history is read). Then every refusal: version,
hash, fingerprint, orthogonality, a second fold.
"""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from oscar_compile import ArtifactError, CompressionSpec, Rotations, apply, calibrate, load_compressed, save_compressed
from oscar_compile.checkpoint import apply_compression, compression_of
from oscar_compile.cli import main
from oscar_compile.loading import BUNDLED_MODEL_DIR, load_model
from oscar_compile.spec import shipped_spec
from oscar_compile.testing import tiny_model, tiny_tokenizer

SPEC = CompressionSpec.from_dict({"kv_cache": {"sink_tokens": 16, "recent_tokens": 32},
                                  "key": {"center": True}, "value": {"granularity": "per_head"}})
PROMPT_LEN = 96  # past 16 sink + 32 recent: history rows are quantized and read back


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory, tokenizer):
    """A plain HF directory of a tiny Qwen2 (attention biases: v_proj's bias is folded too)."""
    path = tmp_path_factory.mktemp("plain")
    model = tiny_model("qwen2", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=len(tokenizer))
    model.save_pretrained(path, max_shard_size="100KB")  # sharded: the export must keep the same shards
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rotations(plain_dir):
    model, _ = load_model(plain_dir, "cpu")
    return calibrate(model, SPEC, [torch.randint(0, 300, (2, 64))])


@pytest.fixture(scope="module")
def compressed_dir(tmp_path_factory, plain_dir, rotations):
    model, tokenizer = load_model(plain_dir, "cpu")
    return save_compressed(model, SPEC, rotations, tmp_path_factory.mktemp("ckpt") / "out", tokenizer=tokenizer)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _applied(plain_dir, rotations):
    model, _ = load_model(plain_dir, "cpu")
    apply(model, SPEC, rotations)
    return model


def test_round_trip_logits_equal_the_saved_model(plain_dir, rotations, compressed_dir):
    ids = torch.randint(0, 300, (2, PROMPT_LEN))
    loaded, tokenizer = load_compressed(compressed_dir)
    assert torch.equal(_logits(loaded, ids), _logits(_applied(plain_dir, rotations), ids))
    assert tokenizer is not None and len(tokenizer) == len(tiny_tokenizer())
    model, _ = load_model(compressed_dir, "cpu")  # what load_compressed does, keeping apply's handle
    compressed = apply_compression(model, compression_of(compressed_dir))
    assert compressed.model is model and torch.equal(_logits(model, ids), _logits(loaded, ids))
    assert all(layer.value_folded for layer in compressed.report.layers) and compressed.report.spec.key.center


def test_the_checkpoint_is_sharded_like_its_source_and_holds_folded_weights(plain_dir, rotations, compressed_dir):
    source = json.loads((plain_dir / "model.safetensors.index.json").read_text())["weight_map"]
    written = json.loads((compressed_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert written == source and len(set(source.values())) > 1
    name = "model.layers.0.self_attn.v_proj.weight"
    old = load_file(str(plain_dir / source[name]))[name]
    new = load_file(str(compressed_dir / written[name]))[name]
    r = rotations.v[0].double()  # [H_kv, D, D]
    expected = (r.transpose(1, 2) @ old.double().reshape(2, 32, -1)).reshape(old.shape).float()
    assert torch.equal(new, expected)
    block = json.loads((compressed_dir / "config.json").read_text())["oscar_compression"]
    assert block["format"] == "oscar_compile.compressed" and block["format_version"] == 1
    assert block["values_folded"] is True and block["rotations"] == "oscar_rotations.safetensors"
    assert CompressionSpec.from_dict(block["spec"]).key.center
    assert not list(compressed_dir.glob("*.bin")) and not list(compressed_dir.glob("*.pt"))


def test_a_model_without_a_source_checkpoint_is_written_as_one_file(tmp_path, tokenizer):
    model = tiny_model("qwen3", num_layers=2, head_dim=32, vocab_size=len(tokenizer))
    spec = shipped_spec("hadamard-int2")
    rot = calibrate(model, spec)
    out = save_compressed(model, spec, rot, tmp_path / "out", tokenizer=tokenizer)
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    ids = torch.randint(0, 300, (1, 400))
    reference = tiny_model("qwen3", num_layers=2, head_dim=32, vocab_size=len(tokenizer))
    apply(reference, spec, rot)
    loaded, _ = load_compressed(out)
    assert torch.equal(_logits(loaded, ids), _logits(reference, ids))


def test_plain_checkpoints_load_as_before(plain_dir):
    assert compression_of(plain_dir) is None
    with pytest.raises(ArtifactError, match="plain Hugging Face checkpoint"):
        load_compressed(plain_dir)


def _copy(compressed_dir, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(compressed_dir, out)
    return out


def _edit_block(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config["oscar_compression"].update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_an_unknown_format_version_is_refused(compressed_dir, tmp_path):
    out = _copy(compressed_dir, tmp_path)
    _edit_block(out, format_version=99)
    with pytest.raises(ArtifactError, match="format version 99"):
        load_compressed(out)


def test_a_rotation_file_outside_the_checkpoint_is_refused(compressed_dir, tmp_path):
    out = _copy(compressed_dir, tmp_path)
    for name in ("../rot.safetensors", str(tmp_path / "rot.safetensors"), ""):
        _edit_block(out, rotations=name)
        with pytest.raises(ArtifactError, match="file name inside the checkpoint"):
            load_compressed(out)


def test_an_edited_rotation_file_is_refused(compressed_dir, tmp_path):
    out = _copy(compressed_dir, tmp_path)
    path = out / "oscar_rotations.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors["layers.0.k"] = tensors["layers.0.k"] * 1.01  # no longer orthogonal
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ArtifactError, match="SHA-256"):
        load_compressed(out)
    import hashlib

    _edit_block(out, rotations_sha256=hashlib.sha256(path.read_bytes()).hexdigest())  # a consistent forgery
    with pytest.raises(ArtifactError, match="not orthogonal"):
        load_compressed(out)


def test_a_fingerprint_of_another_model_is_refused(compressed_dir, tmp_path):
    out = _copy(compressed_dir, tmp_path)
    config = json.loads((out / "config.json").read_text())
    fingerprint = dict(config["oscar_compression"]["fingerprint"], num_heads=8)
    _edit_block(out, fingerprint=fingerprint)
    with pytest.raises(ArtifactError, match="fingerprint"):
        load_compressed(out)


def test_applying_a_spec_to_a_compressed_checkpoint_loaded_plainly_is_refused(compressed_dir, rotations):
    model, _ = load_model(compressed_dir, "cpu")  # transformers reads it as a plain model: R_V folded in
    with pytest.raises(ArtifactError, match="load_compressed"):
        apply(model, SPEC, rotations)
    with pytest.raises(ValueError, match="already a compressed checkpoint"):
        save_compressed(model, SPEC, rotations, compressed_dir.parent / "again")


def test_llm_and_serve_pick_up_spec_and_rotations(plain_dir, rotations, compressed_dir, monkeypatch):
    from oscar_compile import SamplingParams
    from oscar_compile.llm import LLM

    prompt = np.random.default_rng(0).integers(3, 300, PROMPT_LEN).tolist()
    params = SamplingParams(max_tokens=4, temperature=0)
    from_dir = LLM(str(compressed_dir), device="cpu").generate([prompt], params)[0].outputs[0].token_ids
    model, tokenizer = load_model(plain_dir, "cpu")
    expected = LLM(model, SPEC, rotations, tokenizer=tokenizer).generate([prompt], params)[0].outputs[0].token_ids
    assert from_dir == expected and len(from_dir) == 4
    with pytest.raises(ValueError, match="brings its own spec"):
        LLM(str(compressed_dir), spec=SPEC, rotations=rotations)

    from oscar_compile.cli import serve

    args = serve.parse_args(["--model", str(compressed_dir), "--device", "cpu", "--kv-memory", "0.01"])
    app, name = serve.app_from_args(args)
    assert name == compressed_dir.name
    with pytest.raises(ValueError, match="drop --spec"):
        serve.app_from_args(serve.parse_args(["--model", str(compressed_dir), "--spec", "x.yaml"]))


def test_cli_export_hf_on_the_bundled_model(tmp_path, capsys):
    out = tmp_path / "bundled-int2"
    assert main(["export", "--format", "hf", "--out", str(out)]) == 0
    assert "compressed Hugging Face checkpoint" in capsys.readouterr().out
    compression = compression_of(out)
    assert compression.spec == shipped_spec("oscar-int2") and compression.dtype == "bfloat16"
    source = json.loads((BUNDLED_MODEL_DIR / "model.safetensors.index.json").read_text())["weight_map"]
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == source
    rotations = Rotations.load(BUNDLED_MODEL_DIR / "rotations" / "oscar-int2.safetensors")
    assert torch.equal(compression.load_rotations().k[3], rotations.k[3])
    assert main(["export", "--format", "hf", "--out", str(out)]) == 2  # not empty: refused
    assert "not empty" in capsys.readouterr().err
