"""Errors of the 8-bit integer kernel and of today's Gluon kernel against attention_ref on the GPU
tests' cases (queries and keys with outlier channels, kernels/testing.random_kv). One JSON line each."""
import json
import sys

import torch

sys.path.insert(0, "tests/kernels")
from test_attention_gluon_int8 import make_args, rel_err, with_masked  # noqa: E402

from oscar_compile.kernels.attention_gluon import attention_gluon  # noqa: E402
from oscar_compile.kernels.attention_gluon_int8 import attention_gluon_int8  # noqa: E402
from oscar_compile.kernels.attention_ref import attention_ref  # noqa: E402
from oscar_compile.kernels.testing import build_case  # noqa: E402

LENS = [0, 9, 48, 150, 1000, 333, 2100, 5001]
CASES = {  # name: (build_case args, kwargs, chunk_lens, H_q, q_gain)
    "ragged_qwen_layer": ((LENS, 8, 128, 16, 64, 256), {}, [1] * 8, 32, 1.0),
    "ragged_small_windows_gqa8": ((LENS, 2, 128, 16, 16, 32), {}, [1] * 8, 16, 1.0),
    "ragged_gqa1": ((LENS, 4, 128, 16, 16, 32), {}, [1] * 8, 4, 1.0),
    "two_token_chunks": (([700, 70, 20, 1300], 2, 128, 16, 16, 128), {}, [2, 2, 2, 2], 8, 1.0),
    "prefix_hits": (([70, 64, 84, 61, 5], 2, 128), dict(hits=[0, 64, 64, 48, 0]), [2, 1, 2, 2, 1], 8, 1.0),
    "flat_32k": (([32768, 20000], 1, 128, 16, 16, 32), {}, [1, 1], 4, 0.02),
    "peaked_8k": (([8192, 3000], 1, 128, 16, 16, 32), {}, [1, 1], 4, 4.0),
}
for name, (a, kw, chunks, H_q, gain) in CASES.items():
    case = build_case(*a, seed=21, extra_tokens=4, device="cuda", **kw)
    args = make_args(case, chunks, H_q, seed=22, q_gain=gain)
    ref = attention_ref(*args)
    row = {"case": name, "int8_vs_ref": rel_err(attention_gluon_int8(*with_masked(args)), ref),
           "int8_det_vs_ref": rel_err(attention_gluon_int8(*with_masked(args), deterministic=True), ref),
           "gluon_vs_ref": rel_err(attention_gluon(*args), ref)}
    print(json.dumps(row), flush=True)
    torch.cuda.empty_cache()
