"""INT2 decoding through HF generate() against a step-by-step reference written here.

The reference recomputes the whole sequence at every step with the *original* model and a plain
attention function: query position t sees key/value p fake-quantized (rotated basis, reference
quantizer, clipping) exactly when the compressed cache would hold p in its history at that time:
S0 <= p < t - W, for every t under the decode-consistent prefill semantics (the default: a prompt
token reads the cache as a decode step at its position), and for t past the prompt only (decoded
one token at a time) under prompt-exact, where the prompt, prefilled in one chunk, attends in full
precision. Each test runs in both semantics (``set_prefill_semantics``).
"""
import pytest
import torch
from transformers import AttentionInterface

from oscar_compile import CompressionSpec, apply, calibrate
from oscar_compile.formats.prefill import DECODE_CONSISTENT, PROMPT_EXACT
from oscar_compile.passes.apply import set_prefill_semantics
from oscar_compile.quant import fake_quantize
from oscar_compile.testing import tiny_model

SINK, RECENT, HEAD_DIM = 4, 8, 32


def _spec(bits=2, center=True):
    return CompressionSpec.from_dict({
        "kv_cache": {"bits": bits, "group_size": 16, "sink_tokens": SINK, "recent_tokens": RECENT, "page_size": 4},
        "key": {"rotation": "oscar", "center": center, "clip_ratio": 0.9},
        "value": {"rotation": "oscar", "granularity": "per_head", "clip_ratio": 0.85},
    })


class ReferenceAttention:
    """Plain attention with the compressed cache's quantization pattern, for one prompt length.
    ``prompt_len``: the positions that attend in full precision (prompt-exact; 0: decode-consistent)."""

    def __init__(self, rotations, spec, prompt_len):
        self.rot, self.spec, self.prompt_len = rotations, spec, prompt_len

    def __call__(self, module, q, k, v, mask, scaling, **kwargs):
        i = module.layer_idx
        layer = self.spec.for_layer(i, self.rot.num_layers)
        kv = layer.kv_cache
        H_q, H_kv, T = q.shape[1], k.shape[1], q.shape[2]
        g = H_q // H_kv
        rk, rv, mu = self.rot.k[i], self.rot.v[i], self.rot.k_mean[i]
        kr = torch.einsum("bhtd,hde->bhte", k - mu[None, :, None], rk)
        qr = torch.einsum("bhtd,hde->bhte", q, rk.repeat_interleave(g, 0))
        vr = torch.einsum("bhtd,hde->bhte", v, rv)
        kq = fake_quantize(kr, kv.bits, kv.group_size, layer.key.clip_ratio, kv.scale_dtype)
        vq = fake_quantize(vr, kv.bits, kv.group_size, layer.value.clip_ratio, kv.scale_dtype)
        t = torch.arange(T)[:, None]
        p = torch.arange(T)[None, :]
        quantized = (t >= self.prompt_len) & (p >= kv.sink_tokens) & (p < t - kv.recent_tokens)  # [T, T]
        kr, kq, vr, vq = (x.repeat_interleave(g, 1) for x in (kr, kq, vr, vq))
        scores = torch.where(quantized, qr @ kq.transpose(-1, -2), qr @ kr.transpose(-1, -2)) * scaling
        scores = scores.masked_fill(p > t, float("-inf"))
        probs = scores.softmax(-1)
        out = (probs * quantized) @ vq + (probs * ~quantized) @ vr  # [B, H_q, T, D] in the R_V basis
        out = torch.einsum("bhtd,hed->bhte", out, rv.repeat_interleave(g, 0))  # back: o_proj is unfolded here
        return out.transpose(1, 2), None


def _full_precision_prefix(prompt, semantics: str) -> int:
    return prompt.shape[1] if semantics == PROMPT_EXACT else 0


def _reference_generate(model, rot, spec, prompt, num_new, semantics):
    ref = ReferenceAttention(rot, spec, _full_precision_prefix(prompt, semantics))
    AttentionInterface.register("oscar_test_reference", ref)
    model.config._attn_implementation = "oscar_test_reference"
    seq = prompt
    with torch.no_grad():
        for _ in range(num_new):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    model.config._attn_implementation = "sdpa"
    return seq


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("qwen3", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, vocab_size=64, seed=3)
    spec = _spec()
    rot = calibrate(model, spec, [torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(1))])
    compressed = tiny_model("qwen3", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, vocab_size=64,
                            seed=3)
    apply(compressed, spec, rot)  # the default semantics: decode-consistent
    return model, compressed, rot, spec


@pytest.fixture(params=[DECODE_CONSISTENT, PROMPT_EXACT])
def semantics(request, setup):
    """The compressed model's prefill semantics for one test, restored to the default after it."""
    set_prefill_semantics(setup[1], request.param)
    yield request.param
    set_prefill_semantics(setup[1], DECODE_CONSISTENT)


@pytest.mark.parametrize("prompt_len", [6, SINK + RECENT + 9])
def test_greedy_generate_equals_the_step_by_step_reference(setup, semantics, prompt_len):
    model, compressed, rot, spec = setup
    prompt = torch.randint(0, 64, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    num_new = 2 * (SINK + RECENT)  # long enough that decoded tokens themselves get demoted
    ours = compressed.generate(prompt, max_new_tokens=num_new, do_sample=False, min_new_tokens=num_new)
    expected = _reference_generate(model, rot, spec, prompt, num_new, semantics)
    assert torch.equal(ours, expected)


def test_batched_left_padded_generation_matches_single_rows(setup, semantics):
    _, compressed, _, _ = setup
    g = torch.Generator().manual_seed(5)
    long, short = torch.randint(1, 64, (1, 20), generator=g), torch.randint(1, 64, (1, 9), generator=g)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 11, dtype=torch.long), short], 1)])
    mask = torch.cat([torch.ones(1, 20), torch.cat([torch.zeros(1, 11), torch.ones(1, 9)], 1)]).long()
    batched = compressed.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                  pad_token_id=0)
    single_long = compressed.generate(long, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    single_short = compressed.generate(short, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.equal(batched[0, 20:], single_long[0, 20:])
    assert torch.equal(batched[1, 20:], single_short[0, 9:])


def test_returned_cache_keeps_working_for_teacher_forcing(setup, semantics):
    model, compressed, rot, spec = setup
    prompt = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(9))
    out = compressed.generate(prompt, max_new_tokens=RECENT + 6, min_new_tokens=RECENT + 6, do_sample=False,
                              return_dict_in_generate=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    seq = out.sequences
    forced = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(10))
    # the last generated token was never fed back: feed it and the forced tokens one at a time
    logits = []
    for tok in torch.cat([seq[:, -1:], forced], 1).split(1, dim=1):
        logits.append(compressed(input_ids=tok, past_key_values=cache).logits[:, -1])
    full = torch.cat([seq, forced], 1)
    ref = ReferenceAttention(rot, spec, _full_precision_prefix(prompt, semantics))
    AttentionInterface.register("oscar_test_reference", ref)
    model.config._attn_implementation = "oscar_test_reference"
    expected = model(full, use_cache=False).logits[:, seq.shape[1] - 1:]
    model.config._attn_implementation = "sdpa"
    assert torch.allclose(torch.stack(logits, 1), expected, atol=1e-4)
