"""Perplexity through the decode attention kernels: ``python -m oscar_compile.bench.decode_ppl``.

    python -m oscar_compile.bench.decode_ppl [--context 4096] [--num-samples 64] [--scored 256]
        [--kernels triton auto] [--batch-size 16] [--device cuda] [--out decode_ppl.json]

``oscar-compile eval`` scores a continuation in one forward (a torch simulation of the cache):
it never runs a decode kernel. A kernel that changes the decode arithmetic (issue #32: 8-bit
queries and P' in the int8 Gluon kernel) is measured here instead: the bundled model, rewritten
by ``apply`` with its shipped spec and rotations, prefills ``context - scored`` tokens of each
held-out window, then takes the ``scored`` true tokens one decode step at a time (teacher
forcing), each step's attention running through ``oscar::attention`` on the device. Every
kernel setting (an ``AttentionDispatch`` each, the values of ``OSCAR_ATTENTION_KERNEL``: ``triton``
the fused Triton kernel, ``auto`` the dispatch, on sm_90 the int8 kernel for INT2 decode) scores the same windows,
so the difference is paired: per window ``nll_b - nll_a``, its mean and standard error.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from oscar_compile.evaluation.result_file import save_json
from oscar_compile.kernels.attention.attention_dispatch import ENV, AttentionDispatch, KernelUsage


def teacher_forced_nll(model, windows: torch.Tensor, scored: int) -> torch.Tensor:
    """[n] mean NLL of each window's last ``scored`` tokens, each predicted by a decode step."""
    prefix = windows[:, : windows.shape[1] - scored]
    out = model.generate(
        prefix, max_new_tokens=1, do_sample=False, return_dict_in_generate=True, output_logits=True, use_cache=True
    )
    cache = getattr(out, "past_key_values", None) or out.cache
    logits = out.logits[0].float()  # [n, V]: the prediction of token prefix_len
    nll = torch.zeros(windows.shape[0], device=windows.device)
    for t in range(prefix.shape[1], windows.shape[1]):
        target = windows[:, t]
        nll += torch.nn.functional.cross_entropy(logits, target, reduction="none")
        if t + 1 < windows.shape[1]:
            step = model(input_ids=target[:, None], past_key_values=cache, use_cache=True)
            logits = step.logits[:, -1].float()
    return nll / scored


def main(argv=None) -> int:
    from oscar_compile import Rotations, apply, calibrate
    from oscar_compile.evaluation.heldout import bos_id, heldout_windows, read_tokens
    from oscar_compile.loading import BUNDLED_MODEL_DIR, load_model
    from oscar_compile.spec import shipped_spec

    p = argparse.ArgumentParser(prog="python -m oscar_compile.bench.decode_ppl", description=__doc__.split("\n")[0])
    p.add_argument("--spec", default="oscar-int2", help="shipped spec, with the bundled model's rotations for it")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--scored", type=int, default=256)
    p.add_argument("--kernels", nargs="+", default=["triton", "auto"], help=f"{ENV} settings, side by side")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out")
    args = p.parse_args(argv)

    model, tokenizer = load_model(BUNDLED_MODEL_DIR, args.device)
    spec = shipped_spec(args.spec)
    path = BUNDLED_MODEL_DIR / "rotations" / f"{args.spec}.safetensors"
    apply(model, spec, Rotations.load(path) if path.exists() else calibrate(model, spec))  # no file: data-free specs
    tokens = read_tokens(BUNDLED_MODEL_DIR / "heldout.bin", tokenizer)
    windows = heldout_windows(tokens, args.context, args.num_samples, bos_id(model, tokenizer)).to(args.device)
    nll: dict[str, list[float]] = {}
    used: dict[str, dict] = {}
    for kernel in args.kernels:
        dispatch = AttentionDispatch(kernel, usage=KernelUsage())  # (a step spanning the windows: plans by shape)
        with dispatch.step():
            rows = [teacher_forced_nll(model, b, args.scored) for b in windows.split(args.batch_size)]
        nll[kernel] = torch.cat(rows).tolist()
        used[kernel] = dispatch.usage.snapshot()
    base = args.kernels[0]
    result = dict(spec=args.spec, context=args.context, scored=args.scored, windows=len(windows), kernels={})
    for kernel in args.kernels:
        diff = [b - a for a, b in zip(nll[base], nll[kernel], strict=True)]
        se = statistics.stdev(diff) / math.sqrt(len(diff)) if len(diff) > 1 else float("nan")
        result["kernels"][kernel] = dict(
            ppl=math.exp(statistics.mean(nll[kernel])),
            cost_vs_first=math.exp(statistics.mean(diff)) - 1,
            cost_se=se,
            kernels_seen=used[kernel],
            nll=nll[kernel],
        )
        print(f"{kernel:>8}  ppl {result['kernels'][kernel]['ppl']:.5f}  vs {base}: "
              f"{100 * result['kernels'][kernel]['cost_vs_first']:+.4f} % (SE {100 * se:.4f} %)  {used[kernel]}")
    save_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
