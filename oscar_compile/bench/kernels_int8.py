"""Launch-plan sweep of the 8-bit integer Hopper decode (``bench.kernels --parts int8-variants``).

At one (context, batch) of the benchmark layer: the default plan, half and twice its history
splits, twice the planned window programs, the merge as a programmatic dependent launch, the
first step loaded the other way round (before / after the query work; with and without it), the
deterministic mode (fixed 2048-token splits, in-order merge), and the merge of the default
plan's partials alone (``merge_us``: what batch 1 pays after the decode launch). Same timing as
the attention table (CUDA-graph replays over L2-flushing layer buffers).
"""
from __future__ import annotations

import json

import torch

from oscar_compile.bench.kernel_setup import (
    H_KV,
    H_Q,
    HBM_BYTES_PER_S,
    RECENT,
    SINK,
    D,
    attention_args,
    graph_time_us,
)


def bench_int8_variants(ctx: int, B: int, decode_case: tuple) -> list[dict]:
    """``decode_case``: bench.kernels._decode_case(ctx, B) (inputs, the L2-flushing layers)."""
    from oscar_compile.kernels.attention.attention_blocks_triton import merge_partials
    from oscar_compile.kernels.attention.decode.attention_gluon_int8 import (
        EARLY_STEPS,
        STEP_TOKENS,
        attention_gluon_int8,
        plan_int8_launch,
    )

    dev, q, kn, cu, lens, nbytes, layers, max_hist = decode_case
    g = H_Q // H_KV
    nsplit, nwin = plan_int8_launch(B, H_KV, g, max_hist, SINK, RECENT, dev)
    steps = -(-max_hist // STEP_TOKENS)
    early = -(-steps // nsplit) <= EARLY_STEPS  # the planned choice
    sweep = [dict(), dict(nsplit=max(1, nsplit // 2)), dict(nsplit=2 * nsplit), dict(win_splits=2 * nwin),
             dict(pdl=True), dict(early_load=not early), dict(early_load=not early, pdl=True),
             dict(deterministic=True), dict(deterministic=True, pdl=True)]
    out = []
    for kw in sweep:
        row = {"context": ctx, "batch": B, "planned_nsplit": nsplit, "planned_nwin": nwin, **kw}
        try:
            t = graph_time_us([lambda p=p, tb=tb, kw=kw: attention_gluon_int8(
                **attention_args(q, kn, kn, cu, lens, tb, p, D ** -0.5), **kw) for p, tb in layers])
            row.update(us=t, pct_hbm=100 * nbytes / (t * 1e-6) / HBM_BYTES_PER_S)
        except Exception as e:  # a variant that fails is reported, not fatal
            row["error"] = repr(e)[:300]
        out.append(row)
        print(json.dumps(row), flush=True)
    ns = nsplit + nwin
    po = torch.randn(B * H_Q * ns, D, device=dev)
    pl = torch.randn(B * H_Q * ns, device=dev)
    res = torch.empty(B, H_Q, D, device=dev, dtype=torch.bfloat16)
    out.append({"context": ctx, "batch": B, "partials": ns,
                "merge_us": graph_time_us([lambda: merge_partials(po, pl, res, ns)] * 8)})
    print(json.dumps(out[-1]), flush=True)
    del layers, decode_case
    torch.cuda.empty_cache()
    return out
