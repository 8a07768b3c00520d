"""The paged decode-consistent prefill (kernels/attention/prefill) against attention_decode_consistent_ref.

Cases: ragged batches over stored caches (an empty
cache whose chunk crosses the sink and the window, short caches, caches with INT-b history, an
empty sequence; with ``hits`` the states after prefix-cache hits), planar and masked INT2, INT4,
a 16-bit layer, GQA 1 to 4 (3 included: a block of tokens times 3 heads pads its rows), bf16 and
float32 windows, chunks in several calls, each written (cache_write_ref) before the
next: chunk boundaries inside pages and at page boundaries (pages of 16 tokens), and chunks that
start inside the recent window.

Tolerances as there: float32 windows and queries, IEEE float32 dots: 2e-5 (the reference up to the
summation order); bf16: relative Frobenius error 1e-2 (a key read from the wrong version or a
position off by one gives O(1) on some rows). The band pre-pass is compared bitwise.
"""

from __future__ import annotations

import os

import pytest
import torch

from oscar_compile.kernels.attention.prefill.attention_decode_consistent_ref import (
    as_history,
    attention_decode_consistent_ref,
)
from oscar_compile.kernels.cache_write.cache_write_ref import cache_write_ref
from oscar_compile.kernels.testing import build_case, random_kv

LENS = [0, 20, 70, 5, 48, 130]
NEW = [50, 3, 45, 1, 0, 20]
HITS = [0, 16, 64, 0, 48, 100]

CASES = [  # H_q, H_kv, D, bits, G, window dtype, scale dtype, S0, W
    (2, 2, 64, 2, 32, torch.float32, torch.float16, 16, 32),  # planar INT2 (D 64), no GQA
    (4, 2, 128, 2, 64, torch.float32, torch.float16, 16, 32),  # masked INT2 (D 128), GQA 2
    (4, 1, 128, 4, 32, torch.float32, torch.bfloat16, 16, 16),  # INT4, GQA 4
    (4, 2, 64, 16, 64, torch.float32, torch.float16, 16, 32),  # a 16-bit layer beside INT-b ones
    (4, 2, 64, 2, 64, torch.float32, torch.float32, 0, 16),  # no sink
    (4, 2, 64, 2, 64, torch.float32, torch.float16, 16, 0),  # no recent window
    (4, 1, 128, 2, 128, torch.bfloat16, torch.float16, 32, 16),  # bf16 windows, masked INT2
    (6, 2, 64, 2, 64, torch.float32, torch.float16, 16, 32),  # GQA 3
    (2, 2, 64, 4, 64, torch.bfloat16, torch.float16, 16, 32),  # bf16 windows, INT4
]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """The interpreter (TRITON_INTERPRET=1) on the CPU, or a CUDA device (marker ``gpu``)."""
    pytest.importorskip("triton")
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if request.param == "cuda":
        if interpreting or not torch.cuda.is_available():
            pytest.skip("needs a CUDA device and TRITON_INTERPRET unset")
    elif not interpreting:
        if os.environ.get("CI"):
            pytest.fail("CI: TRITON_INTERPRET is not set, so no kernel would run")
        pytest.skip("TRITON_INTERPRET is not set")
    return request.param


def _case(params, device, hits=None, extra_tokens=50, lens=LENS):
    H_q, H_kv, D, bits, G, wdt, sdt, sink, recent = params
    return build_case(lens, H_kv, D, 16, sink, recent, bits, G, sdt, wdt, seed=bits + D, hits=hits,
                      extra_tokens=extra_tokens, device=device)  # fmt: skip


def _tokens(params, new, device, seed=0, dtype=None):
    H_q, H_kv, D, *_, wdt = params[:6]
    gen = torch.Generator().manual_seed(seed)
    return tuple(random_kv(sum(new), h, D, gen, dtype or wdt, device) for h in (H_q, H_kv, H_kv))


def _args(case, q, k, v, new):
    cu = torch.tensor([0] + new).cumsum(0).to(device=q.device, dtype=torch.int32)
    return (q, k, v, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools, q.shape[2] ** -0.5,
            case.sink, case.recent, case.bits, case.group_size, case.clip_k, case.clip_v)  # fmt: skip


def _paged(*args, **kw):
    from oscar_compile.kernels.attention.prefill.decode_consistent_paged_triton import (
        attention_decode_consistent_paged_triton,
    )

    return attention_decode_consistent_paged_triton(*args, **kw)


def _check(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    else:
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-2, err


def _write(case, k, v, new):
    cu = torch.tensor([0] + new).cumsum(0).to(device=k.device, dtype=torch.int32)
    cache_write_ref(k, v, cu, case.cache_lens, case.window_table, case.quant_table, *case.pools, case.sink,
                    case.recent, case.bits, case.group_size, case.clip_k, case.clip_v,
                    history_lens=case.history_lens)  # fmt: skip
    case.append(k, v, cu)


@pytest.mark.parametrize("params", CASES)
@pytest.mark.parametrize("hits", [None, HITS], ids=["standard", "hits"])
def test_matches_reference(device, params, hits):
    case = _case(params, device, hits)
    q, k, v = _tokens(params, NEW, device)
    args = _args(case, q, k, v, NEW)
    _check(_paged(*args, history_lens=case.history_lens),
           attention_decode_consistent_ref(*args, history_lens=case.history_lens))  # fmt: skip


@pytest.mark.parametrize("params", [CASES[1], CASES[6]])
def test_small_tiles_match_reference(device, params):
    """16 rows and 16 keys per tile: several query blocks per sequence, run edges inside key blocks."""
    case = _case(params, device, HITS)
    q, k, v = _tokens(params, NEW, device, seed=1)
    args = _args(case, q, k, v, NEW)
    _check(_paged(*args, history_lens=case.history_lens, block_rows=16, block_n=16),
           attention_decode_consistent_ref(*args, history_lens=case.history_lens))  # fmt: skip


def _check_partial(got, want):
    """history="partial": the stored history's dots take q rounded to fp16 (the extend kernel's
    history loop, as every decode step over these pages), against float32 dots in the reference."""
    assert got.dtype == want.dtype and got.shape == want.shape
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < (2e-3 if want.dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("params", CASES[:5])
@pytest.mark.parametrize("hits", [None, HITS], ids=["standard", "hits"])
def test_history_partial_matches_reference(device, params, hits):
    """The stored history by the extend kernel's loop (history_partial_triton) and joined to the
    paged kernel's softmax, also on the float32 windows whose default is the folded loop; the
    other two paths too ("tiles" exact). INT4 at head_dim 128 in groups of 32 splits the extend
    kernel's 64-channel planes: refused, and the default reads the history in this kernel."""
    from oscar_compile.kernels.attention.prefill.history_partial_triton import takes

    case = _case(params, device, hits)
    q, k, v = _tokens(params, NEW, device, seed=2)
    args = _args(case, q, k, v, NEW)
    want = attention_decode_consistent_ref(*args, history_lens=case.history_lens)
    H_q, H_kv, D, bits, G = params[:5]
    if takes(H_q, H_kv, D, bits, G, 128):
        _check_partial(_paged(*args, history_lens=case.history_lens, history="partial"), want)
    else:
        with pytest.raises(ValueError, match="cannot take"):
            _paged(*args, history_lens=case.history_lens, history="partial")
    _check(_paged(*args, history_lens=case.history_lens, history="tiles"), want)


@pytest.mark.parametrize("params", [CASES[1], CASES[6]])
@pytest.mark.parametrize("chunks", [[16, 16, 7], [5, 27, 7]], ids=["pages", "ragged"])
@pytest.mark.parametrize("asm", [None, pytest.param(False, marks=pytest.mark.gpu)], ids=["auto", "plain-decode"])
def test_history_partial_chunked_small_tiles(device, params, chunks, asm):
    """Chunks written one after the other, 16-row and 16-key programs in both launches: several
    query blocks per sequence, history blocks ending inside pages. On a GPU also with the codes
    decoded without inline PTX (the interpreter's decode; ``history_asm``)."""
    case = _case(params, device, extra_tokens=39)
    for step, n in enumerate(chunks):
        new = [n] * len(LENS)
        q, k, v = _tokens(params, new, device, seed=step)
        args = _args(case, q, k, v, new)
        got = _paged(*args, history_lens=case.history_lens, block_rows=16, block_n=16, history="partial",
                     history_rows=16, history_block_n=16, history_asm=asm)  # fmt: skip
        _check_partial(got, attention_decode_consistent_ref(*args, history_lens=case.history_lens))
        _write(case, k, v, new)


def test_history_mode_is_checked():
    with pytest.raises(ValueError, match="history must be one of"):
        _paged(*([None] * 22), history="fast")


@pytest.mark.parametrize("params", [CASES[0], CASES[1], CASES[2]])
@pytest.mark.parametrize("chunks", [[13, 13, 13], [16, 16, 7], [5, 27, 7]], ids=["13", "pages", "ragged"])
def test_chunked_prompt_matches_reference(device, params, chunks):
    """A prompt in chunks, each written before the next: later chunks read earlier ones from the
    history pages and the ring. ``pages``: from the empty sequence, boundaries at page boundaries
    (16 tokens); the others inside pages; chunks after the first start inside the window."""
    case = _case(params, device, extra_tokens=39)
    for step, n in enumerate(chunks):
        new = [n] * len(LENS)
        q, k, v = _tokens(params, new, device, seed=step)
        args = _args(case, q, k, v, new)
        _check(_paged(*args, history_lens=case.history_lens, block_rows=16, block_n=16),
               attention_decode_consistent_ref(*args, history_lens=case.history_lens))  # fmt: skip
        _write(case, k, v, new)


def test_own_token_as_passed(device):
    """float32 tokens over bf16 windows: own key and value as passed, the chunk's others rounded."""
    case = _case(CASES[6], device, HITS)
    q, k, v = _tokens(CASES[6], NEW, device, seed=2, dtype=torch.float32)
    args = _args(case, q, k, v, NEW)
    _check(_paged(*args, history_lens=case.history_lens),
           attention_decode_consistent_ref(*args, history_lens=case.history_lens))  # fmt: skip


@pytest.mark.parametrize("params", [CASES[1], CASES[2], CASES[6]])
@pytest.mark.usefixtures("row_invariant_dot")  # the kernel's invariance, not the host BLAS's (conftest)
def test_deterministic_rows_do_not_depend_on_the_chunking(device, params):
    """Deterministic mode: 39 tokens per sequence in one call equal, bitwise, chunks of 13, of
    16 + 16 + 7 (page boundaries), of 2 + 37 and of 1 + 11 + 27, each written before the next. A
    position reads the same operand from the band or, in a later chunk, from its page. Three
    sequences (an empty cache, one inside the window's reach, one with INT-b history) keep the
    interpreter's time down; the other cases use all of ``LENS``."""
    from oscar_compile.kernels.determinism import deterministic

    lens = [0, 70, 130]
    prompt = _tokens(params, [39] * len(lens), device, seed=3)

    def run(chunks):
        case = _case(params, device, extra_tokens=39, lens=lens)
        out, done = [], 0
        for n in chunks:
            rows = torch.cat([torch.arange(39 * i + done, 39 * i + done + n) for i in range(len(lens))]).to(device)
            q, k, v = (x[rows] for x in prompt)
            with deterministic():
                out.append(_paged(*_args(case, q, k, v, [n] * len(lens)), history_lens=case.history_lens,
                                  block_rows=16, block_n=16).view(len(lens), n, *q.shape[1:]))  # fmt: skip
            _write(case, k, v, [n] * len(lens))
            done += n
        return torch.cat(out, dim=1)

    whole = run([39])
    for chunks in ([13, 13, 13], [16, 16, 7], [2, 37], [1, 11, 27]):
        assert torch.equal(run(chunks), whole), chunks


@pytest.mark.parametrize("params", [CASES[0], CASES[1], CASES[2], CASES[6]])
def test_band_is_what_the_write_stores(device, params):
    """The pre-pass's history band equals, bitwise, the reference's quantizer on the rounded rows
    (``as_history``), and the exact band the window-dtype rows: its codes are those cache_write_ref
    stores (the same quantizer), so a later chunk reads the same operands from the pages."""
    from oscar_compile.kernels.attention.prefill.band_triton import band_cu, write_band

    case = _case(params, device)
    _, k, v = _tokens(params, NEW, device)
    cu = torch.tensor([0] + NEW).cumsum(0).to(device=device, dtype=torch.int32)
    k_win, v_win, _, k_scale, *_ = case.pools
    bcu = band_cu(cu, case.recent)
    bufs = write_band(k, v, cu, bcu, case.cache_lens, None, case.window_table, k_win, v_win, k_scale.dtype,
                      case.sink, case.recent, case.bits, case.group_size, case.clip_k, case.clip_v,
                      torch.float32)  # fmt: skip
    W, S0 = case.recent, case.sink
    for i, L in enumerate(case.cache_lens.tolist()):
        T = NEW[i]
        if T == 0:  # no query reads the band of a sequence without new tokens: not written
            continue
        lo = min(L, S0 + max(0, L - W - S0))
        for x, stream, exact, hist, clip in ((k, case.keys, bufs[0], bufs[1], case.clip_k),
                                             (v, case.values, bufs[2], bufs[3], case.clip_v)):  # fmt: skip
            want = torch.cat([stream[i][lo:L], x[int(cu[i]) : int(cu[i]) + T].to(k_win.dtype)])  # [n, H_kv, D]
            rows = slice(int(bcu[i]) + lo - (L - W), int(bcu[i + 1]))
            assert torch.equal(exact[rows], want.float())
            first = max(S0 - lo, 0)
            got_h = hist[rows][first:]
            want_h = as_history(want[first:], case.bits, case.group_size, clip, k_scale.dtype)
            assert torch.equal(got_h, want_h)


def test_no_new_tokens(device):
    case = _case(CASES[0], device)
    q, k, v = _tokens(CASES[0], [0] * len(LENS), device)
    got = _paged(*_args(case, q, k, v, [0] * len(LENS)))
    assert got.shape == (0, 2, 64)


_COMPILE = """
import json, sys
from oscar_compile.kernels.attention.prefill.decode_consistent_paged_triton import compile_offline
out = []
for cfg in json.loads(sys.argv[1]):
    ck = compile_offline(**cfg)
    ptx = ck.asm["ptx"]
    out.append({"local": ("ld.local" in ptx) or ("st.local" in ptx), "shared": ck.metadata.shared,
                "wgmma": ptx.count("wgmma.mma_async")})
print(json.dumps(out))
"""


def test_kernel_compiles_for_sm90():
    """An offline sm_90 compile of the Qwen3-8B layer's kernel (default tiles and fold, the tiles
    the benchmark picks, and deterministic mode): no local memory in the PTX, shared memory within
    the 227 KiB of an sm_90 block, the dots on wgmma. In a child process: under TRITON_INTERPRET=1
    the kernel is an interpreter function."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton")
    configs = [{}, {"block_rows": 128, "num_warps": 8}, {"aligned": True}]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(configs)], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert all(not g["local"] and g["shared"] <= 227 * 1024 and g["wgmma"] > 0 for g in got), got


def test_band_compiles_for_sm90():
    """The band pre-pass built offline for sm_90 (its early exit for sequences without new tokens
    included): no spills. In a child process, as above."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton")
    code = ("import json; from oscar_compile.kernels.attention.prefill.band_triton import compile_offline; "
            "ptx = compile_offline().asm['ptx']; print(json.dumps({'local': 'ld.local' in ptx or 'st.local' in ptx, "
            "'ret': ptx.count('ret;')}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert not got["local"] and got["ret"] >= 1, got


try:  # a module-level kernel: a jit function sees module globals only
    import triton
    import triton.language as tl

    from oscar_compile.kernels.attention.prefill.paged_tiles_triton import code_values

    @triton.jit
    def _decode_int2(c_ptr, out_ptr):
        i = tl.arange(0, 16)
        tl.store(out_ptr + i, code_values(tl.load(c_ptr + i), 2, tl.bfloat16))
except ImportError:
    _decode_int2 = None


def test_int2_codes_decode_to_bf16_exactly(device):
    """The INT2 codes' bf16 values by bit pattern (code_values: the GPU path's operand; the
    interpreter's dots run in float32, so the kernel tests above do not reach it): 0, 1, 2, 3."""
    codes = torch.arange(16, device=device, dtype=torch.int32) % 4
    out = torch.empty(16, device=device, dtype=torch.bfloat16)
    _decode_int2[(1,)](codes, out)
    assert torch.equal(out, codes.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_128k_history_stays_at_the_bf16_rounding_on_the_gpu():
    """64 rows after 131008 stored tokens of flat attention (the benchmark's Qwen3-8B layer and random
    pages), both history paths, against the float32 reference. Accumulated inside the MMA, the value
    sums over the whole history (non-negative codes) drifted from the reference by 8.1 % (partial)
    and 2.4 % (folded) on an H200, where the interpreter's IEEE sums stayed at 0.4 %; promoted per
    tile, 0.26 % / 0.27 % (bench/results/2026-12-05-gpu-int2-prefill-end-to-end, call 25)."""
    from oscar_compile.bench.prefill_paged import reference_errors

    errors = reference_errors(131072, {"history": "partial"}, torch.device("cuda"))
    assert max(errors.values()) < 1e-2, errors
