"""ONNX export with an INT2 KV cache, run by ONNX Runtime on the CPU (CI runs all of it).

A tiny random Qwen3 (2 layers, 2 KV heads, head_dim 32), 16 sink + 32 recent tokens, prompts of
80 tokens so the history is quantized at prefill and grows while decoding. The export goes
through the CLI (``oscar-compile export --format onnx``).

Tolerance of the teacher-forced logits: 1e-4 absolute (logits here are O(1)). The graphs compute
the same float32 formulas as ``apply()``'s CPU path, and the quantize graph's codes, scales and
zeros equal the reference bit for bit (tested below); what remains is summation order: ONNX
Runtime's MatMul / Softmax kernels and the attention over [sink; history; recent] in another
key order than the paged reference, a few float32 ulps per layer.

The exported step graph prefills prompt-exact (a chunk attends to itself in full precision), so
its reference is ``apply()``'s model under that semantics (``set_prefill_semantics``), not the
default, decode-consistent (README, "Export").
"""
import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")  # the [onnx] extra; CI installs it (.ci/run)
ort = pytest.importorskip("onnxruntime")

from oscar_compile import CompressionSpec, apply, calibrate, quant  # noqa: E402
from oscar_compile.cli import main  # noqa: E402
from oscar_compile.formats.prefill import PROMPT_EXACT  # noqa: E402
from oscar_compile.loading import load_model  # noqa: E402
from oscar_compile.onnx import OnnxGenerator  # noqa: E402
from oscar_compile.passes.apply import set_prefill_semantics  # noqa: E402
from oscar_compile.testing import tiny_model, tiny_tokenizer  # noqa: E402

SPEC_YAML = """
version: 1
kv_cache: {bits: 2, group_size: 32, scale_dtype: float16, sink_tokens: 16, recent_tokens: 32, page_size: 16}
key: {rotation: oscar, granularity: per_head, clip_ratio: 0.96, center: true}
value: {rotation: oscar, granularity: per_layer, clip_ratio: 0.92}
"""
PROMPT_LEN, NEW_TOKENS = 80, 12
LOGIT_TOLERANCE = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx")
    tokenizer = tiny_tokenizer()
    model = tiny_model("qwen3", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=len(tokenizer))
    model.generation_config.eos_token_id = None  # greedy runs the full length on both sides
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "spec.yaml").write_text(SPEC_YAML)
    spec = CompressionSpec.from_yaml(root / "spec.yaml")
    rot = calibrate(model, spec, [torch.randint(0, len(tokenizer), (2, 96))])
    rot.save(root / "rot.safetensors")
    assert main(["export", "--format", "onnx", "--model", str(root / "model"), "--spec", str(root / "spec.yaml"),
                 "--rotations", str(root / "rot.safetensors"), "--out", str(root / "onnx"), "--quiet"]) == 0
    return root, spec, rot


def _applied(root, spec, rot):
    model, _ = load_model(root / "model", "cpu")
    apply(model, spec, rot)
    set_prefill_semantics(model, PROMPT_EXACT)  # what the exported graphs compute
    return model


def _prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, PROMPT_LEN).tolist()


def test_graphs_pass_the_checker_and_use_standard_ops(setup):
    root, _, _ = setup
    for name in ("step.onnx", "quantize.onnx"):
        model = onnx.load(str(root / "onnx" / name))
        onnx.checker.check_model(model, full_check=True)
        assert {o.domain for o in model.opset_import} <= {"", "ai.onnx"}
    ops = {n.op_type for n in onnx.load(str(root / "onnx" / "step.onnx")).graph.node}
    assert {"BitShift", "BitwiseAnd", "Softmax"} <= ops  # the codes are unpacked inside the graph


def test_quantize_graph_equals_the_reference_quantizer_bitwise(setup):
    root, spec, _ = setup
    session = ort.InferenceSession(str(root / "onnx" / "quantize.onnx"), providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(37, 2, 32, generator=gen) * 3
    v = torch.randn(37, 2, 32, generator=gen)
    k[0, 0] = 0.0  # an all-zero group: scale 1
    k[1, 1] = 5.0 + torch.arange(32) * 1e-4  # a nearly constant group far from 0: the zero-point floor
    got = session.run(None, {"k": k.numpy(), "v": v.numpy()})
    want = [*quant.quantize(k, 2, 32, spec.key.clip_ratio, "float16"), *quant.quantize(v, 2, 32, spec.value.clip_ratio,
                                                                                   "float16")]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.numpy().dtype and np.array_equal(g, w.numpy())


def test_onnx_reference_evaluator_agrees_with_onnx_runtime(setup):
    """A second opinion on both graphs from ONNX's own reference implementation (small inputs)."""
    from onnx.reference import ReferenceEvaluator

    root, _, _ = setup
    k = np.random.default_rng(1).standard_normal((3, 2, 32)).astype(np.float32)
    feeds = {"k": k, "v": -k}
    ref = ReferenceEvaluator(str(root / "onnx" / "quantize.onnx")).run(None, feeds)
    got = ort.InferenceSession(str(root / "onnx" / "quantize.onnx")).run(None, feeds)
    for r, g in zip(ref, got, strict=True):
        assert np.array_equal(r, g)
    gen = OnnxGenerator(root / "onnx")
    cache = gen.new_cache()
    gen.step(_prompt(2)[:56], cache)  # 16 sink, 8 history, 32 recent
    step_feeds = {"input_ids": np.array([[7, 8]]), "position_ids": np.array([[56, 57]])}
    step_feeds.update(zip(gen.manifest["step"]["inputs"][2:], [np.ascontiguousarray(a) for layer in cache.layers
                                                               for a in layer.inputs()], strict=True))
    ref = ReferenceEvaluator(str(root / "onnx" / "step.onnx")).run(None, step_feeds)
    got = gen.step_session.run(None, step_feeds)
    assert cache.layers[0].num_history == 8
    for r, g in zip(ref, got, strict=True):
        assert np.abs(r - g).max() < LOGIT_TOLERANCE


def test_greedy_tokens_equal_apply_and_generate(setup):
    root, spec, rot = setup
    model = _applied(root, spec, rot)
    gen = OnnxGenerator(root / "onnx", num_threads=1)
    for seed in range(2):
        prompt = _prompt(seed)
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT_LEN:]
        assert gen.generate(prompt, NEW_TOKENS) == expected.tolist()


def test_teacher_forced_logits_within_tolerance(setup):
    from oscar_compile.bench.onnx_cpu import teacher_forced_logits

    root, spec, rot = setup
    gen = OnnxGenerator(root / "onnx", num_threads=1)
    prompt, continuation = _prompt(3), _prompt(4)[:40]  # 40 decode steps: the history grows
    cache = gen.new_cache()
    got = [gen.step(prompt, cache)[-1]] + [gen.step([t], cache)[-1] for t in continuation]
    want = teacher_forced_logits(_applied(root, spec, rot), prompt, continuation).numpy()
    assert cache.length == PROMPT_LEN + 40 and cache.layers[1].num_history == PROMPT_LEN + 40 - 16 - 32
    assert np.abs(np.stack(got) - want).max() < LOGIT_TOLERANCE


def test_refusals(setup, tmp_path):
    root, _, _ = setup
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        OnnxGenerator(tmp_path)
    for i, bad in enumerate([SPEC_YAML + "layers: [{match: [0], kv_cache: {bits: 16}}]\n",  # per-layer formats
                             SPEC_YAML.replace("float16", "bfloat16")]):  # numpy holds no bf16 scales
        (tmp_path / f"spec{i}.yaml").write_text(bad)
        assert main(["export", "--format", "onnx", "--model", str(root / "model"),
                     "--spec", str(tmp_path / f"spec{i}.yaml"),
                     "--rotations", str(root / "rot.safetensors"), "--out", str(tmp_path / f"out{i}")]) == 2
    # a compressed checkpoint has R_V folded already: exporting it would fold it a second time
    from oscar_compile import save_compressed

    _, spec, rot = setup
    model, tokenizer = load_model(root / "model", "cpu")
    ckpt = save_compressed(model, spec, rot, tmp_path / "ckpt", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="compressed checkpoint"):
        from oscar_compile.onnx.export import export_onnx

        export_onnx(ckpt, spec, None, tmp_path / "out-ckpt")


def test_the_driver_imports_numpy_and_onnxruntime_only():
    import subprocess
    import sys

    code = "import sys, oscar_compile.onnx; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_driver_cache_format_version_is_the_library_s(setup, tmp_path):
    """The driver reads the library's cache format version (formats.cache, which imports no torch)
    and refuses an export written under another one."""
    import json
    import shutil

    from oscar_compile.formats.cache import CACHE_FORMAT_VERSION

    root, _, _ = setup
    old = tmp_path / "old"
    shutil.copytree(root / "onnx", old)
    manifest = json.loads((old / "manifest.json").read_text())
    assert manifest["cache_format_version"] == CACHE_FORMAT_VERSION and manifest["code_layout"] == "planar"
    manifest["cache_format_version"] = 1
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="KV-cache format version 1"):
        OnnxGenerator(old)


def test_driver_masked_blocks_equal_the_reference_pack():
    """The driver's one-token-at-a-time OR into masked blocks (numpy) equals code_layout_ref's
    bulk pack of the same codes, also for a partly filled last block."""
    from oscar_compile.kernels.layout import code_layout_ref as cl
    from oscar_compile.onnx.driver import _MaskedBlocks

    codes = torch.randint(0, 4, (40, 2, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    for kind, maps in (("k", cl.key_byte_map()), ("v", cl.value_byte_map())):
        blocks = _MaskedBlocks(2, maps[0].numpy(), maps[1].numpy())
        for start, stop in ((0, 1), (1, 5), (5, 6), (6, 40)):  # one token, a quad edge, a bulk run
            blocks.extend(codes[start:stop].numpy())
        padded = torch.cat([codes, torch.zeros(8, 2, 128, dtype=torch.uint8)])  # 48 rows: 3 blocks
        dense = padded.view(3, 16, 2, 128).transpose(1, 2)  # [blocks, H, 16, D]
        want = cl.pack_page(dense, kind, 2).reshape(3, 2, 512)
        # rows never written hold zero bytes, not the pack of code 0 (whose pair 3 stores 2)
        got = torch.from_numpy(blocks.view.copy())
        assert got.shape == want.shape
        written = cl.unpack_blocks(got, kind).transpose(1, 2).reshape(48, 2, 128)[:40]
        assert torch.equal(written, codes)
        assert torch.equal(got[:2], want[:2])  # the two full blocks, bytewise


@pytest.fixture(scope="module")
def masked_setup(tmp_path_factory):
    """One layer at head_dim 128: INT2 history in masked 16-token blocks (cache format version 2)."""
    root = tmp_path_factory.mktemp("onnx128")
    tokenizer = tiny_tokenizer()
    model = tiny_model("qwen3", num_layers=1, num_heads=2, num_kv_heads=1, head_dim=128, vocab_size=len(tokenizer))
    model.generation_config.eos_token_id = None
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "spec.yaml").write_text(SPEC_YAML)
    spec = CompressionSpec.from_yaml(root / "spec.yaml")
    rot = calibrate(model, spec, [torch.randint(0, len(tokenizer), (2, 96))])
    rot.save(root / "rot.safetensors")
    assert main(["export", "--format", "onnx", "--model", str(root / "model"), "--spec", str(root / "spec.yaml"),
                 "--rotations", str(root / "rot.safetensors"), "--out", str(root / "onnx"), "--quiet"]) == 0
    return root, spec, rot


def test_masked_history_logits_and_tokens_equal_apply(masked_setup):
    """Teacher-forced logits over 21 decode steps (the history grows across a block edge, each
    step ORing one token into its block) within tolerance of apply(), and greedy tokens equal."""
    from oscar_compile.bench.onnx_cpu import teacher_forced_logits

    root, spec, rot = masked_setup
    gen = OnnxGenerator(root / "onnx", num_threads=1)
    assert gen.manifest["code_layout"] == "masked"
    prompt, continuation = _prompt(5), _prompt(6)[:21]
    cache = gen.new_cache()
    got = [gen.step(prompt, cache)[-1]] + [gen.step([t], cache)[-1] for t in continuation]
    assert cache.layers[0].num_history == PROMPT_LEN + 21 - 16 - 32  # 53: 3 full blocks and 5 rows
    model = _applied(root, spec, rot)
    want = teacher_forced_logits(model, prompt, continuation).numpy()
    assert np.abs(np.stack(got) - want).max() < LOGIT_TOLERANCE
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, PROMPT_LEN:]
    assert gen.generate(prompt, 6) == expected.tolist()
