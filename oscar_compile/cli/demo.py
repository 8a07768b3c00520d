"""``oscar-compile demo``: calibrate, apply and generate, end to end, in one command.

With the bundled model (the default when it is installed) it calibrates on the model's shipped
calibration tokens and prints BF16 and compressed generations side by side; ``--tiny`` uses a
randomly initialised tiny Qwen3 instead (no files needed: what CI runs).

The default prompt is longer than the BF16 windows (sink + recent): a prompt that fits in them
never reads the INT2 history, and its agreement with BF16 says nothing about INT2. The demo
prints how many tokens the last step read as INT2.
"""
from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

from ..loading import BUNDLED_MODEL_DIR as BUNDLED_MODEL

# tokens past the sink + recent windows in the default prompt (held-out text of the model's own)
PROMPT_TOKENS_PAST_WINDOWS = 256


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="calibrate + apply + generate on the bundled (or a tiny random) model")
    p.add_argument("--model", default=None, help=f"model directory (default: the bundled model, {BUNDLED_MODEL.name})")
    p.add_argument("--tiny", action="store_true", help="use a tiny random Qwen3 instead of a model directory")
    p.add_argument("--spec", default=None, help="compression spec YAML (default: specs/oscar-int2.yaml)")
    p.add_argument("--prompt", default=None,
                   help="prompt text (default: held-out text of the model's, 256 tokens longer than the BF16 "
                        "sink + recent windows, so that INT2 history is read)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--calib-tokens", type=int, default=None, help="calibration tokens (default: the spec's)")
    p.add_argument("--device", default="auto")
    p.set_defaults(func=run_demo)


def _tiny_setup(args, spec):
    import torch

    from ..testing import tiny_model

    model = tiny_model("qwen3", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=256)
    g = torch.Generator().manual_seed(0)
    calib = torch.randint(0, 256, (4096,), generator=g)
    prompt_ids = torch.randint(0, 256, (1, 400), generator=g)
    return model, None, calib, prompt_ids


def _model_setup(args, spec):
    from ..calibration.tokens import load_tokens
    from ..loading import load_model

    model_dir = Path(args.model) if args.model else BUNDLED_MODEL
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no model at {model_dir} (use --model DIR, or --tiny for a random tiny model)")
    model, tokenizer = load_model(model_dir, args.device, tokenizer_required=False)
    calib_file = model_dir / "calib.bin"
    if not calib_file.is_file():
        raise FileNotFoundError(f"{calib_file} not found: "
                                "the demo calibrates on the model's shipped calibration tokens")
    calib = load_tokens(calib_file)
    if args.prompt is not None:
        prompt_ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    else:
        heldout = model_dir / "heldout.bin"
        if not heldout.is_file():
            raise FileNotFoundError(f"{heldout} not found: pass --prompt TEXT (longer than the BF16 windows)")
        length = spec.kv_cache.sink_tokens + spec.kv_cache.recent_tokens + PROMPT_TOKENS_PAST_WINDOWS
        prompt_ids = load_tokens(heldout)[:length].unsqueeze(0)
    return model, tokenizer, calib, prompt_ids.to(model.device)


def run_demo(args) -> int:
    import torch

    from ..calibration import calibrate
    from ..calibration.tokens import make_batches
    from ..passes import apply
    from ..spec import CompressionSpec, shipped_spec
    from ..spec_fit import fit_spec_to_model

    spec = CompressionSpec.from_yaml(args.spec) if args.spec else shipped_spec("oscar-int2")
    if args.tiny:
        spec = spec.model_copy(update={"kv_cache": spec.kv_cache.model_copy(
            update={"group_size": 64, "sink_tokens": 16, "recent_tokens": 64})})
    num_tokens = args.calib_tokens or spec.calibration.num_tokens
    model, tokenizer, calib, prompt_ids = (_tiny_setup if args.tiny else _model_setup)(args, spec)
    spec = spec.model_copy(update={"calibration": spec.calibration.model_copy(
        update={"num_tokens": num_tokens, "seq_len": min(spec.calibration.seq_len, 1024)})})
    spec = fit_spec_to_model(spec, model)  # once: calibrate and apply take it as fitted
    bos = getattr(tokenizer, "bos_token_id", None)
    start = time.perf_counter()
    rot = calibrate(model, spec, make_batches(calib.to(model.device), spec.calibration, bos), progress=True)
    print(f"calibrated on {rot.num_tokens} tokens in {time.perf_counter() - start:.1f}s "
          f"(`oscar-compile calibrate` writes such rotations to a file; the bundled model ships its own)")
    baseline = copy.deepcopy(model)
    report = apply(model, spec, rot).report
    print(report)
    ctx = prompt_ids.shape[1] + args.max_new_tokens
    print(f"bits per K/V element: {report.bits_per_element(ctx):.2f} at {ctx} tokens, "
          f"{report.bits_per_element():.2f} asymptotically (BF16: 16)")
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    with torch.no_grad():
        ref = baseline.generate(prompt_ids, **gen)[0, prompt_ids.shape[1]:]
        out = model.generate(prompt_ids, **gen)[0, prompt_ids.shape[1]:]
    agree = float((ref == out).float().mean()) if len(ref) == len(out) else float("nan")
    decode = ((lambda ids: tokenizer.decode(ids)) if tokenizer is not None
              else (lambda ids: " ".join(map(str, ids.tolist()))))
    prompt_len, window = prompt_ids.shape[1], spec.kv_cache.sink_tokens + spec.kv_cache.recent_tokens
    shown = (args.prompt or f"...{tokenizer.decode(prompt_ids[0, -40:])}") if tokenizer is not None else "random tokens"
    print(f"\nprompt ({prompt_len} tokens): {shown}")
    print(f"bf16      : {decode(ref)}")
    print(f"compressed: {decode(out)}")
    print(f"greedy-token agreement with BF16: {agree:.2f}")
    # the last step reads positions [sink, ctx - recent) as INT2 (layers of 16 bits aside)
    int2 = max(0, ctx - 1 - window)
    print(f"INT2 history read at the last step: {int2} of {ctx - 1} tokens "
          f"(the {spec.kv_cache.sink_tokens} sink and {spec.kv_cache.recent_tokens} most recent stay BF16)")
    if prompt_len <= window:
        print(f"note: the prompt fits in the BF16 windows ({window} tokens): pass a longer --prompt to compare INT2")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="oscar-compile demo")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    return run_demo(parser.parse_args(["demo", *(argv or [])]))
