"""Measure a saved oscar-tiny-qwen3 checkpoint: perplexity, bits/byte, needle accuracy, KV stats.

Everything goes through the Hugging Face model as shipped (``AutoModelForCausalLM`` on the
saved folder), so the numbers describe the bundled checkpoint, not the training module.

Definitions (also written into the model card):
  * ppl@C: windows of ``<|startoftext|>`` + C-1 consecutive ``heldout.bin`` tokens, non
    overlapping from the file start; every one of the C-1 next-token predictions scored.
  * bits/byte: the same summed NLL / ln 2 / UTF-8 bytes of the scored tokens (byte-level
    BPE: a token's byte count is the length of its token string; special tokens count 0).
  * needle accuracy: ``oscar_compile.data.needle`` prompts built on ``heldout.bin``; correct
    when the greedy continuation reproduces every answer token (teacher-forced argmax,
    which equals greedy decoding over the answer span).
  * key outlier ratio (per layer): post-RoPE keys (as the KV cache stores them); for each KV
    head, m[c] = mean over tokens of |k[c]|; ratio = max_c m[c] / mean_c m[c]; the layer's
    figure is the max over its KV heads. The same for values.
  * first-token attention mass (per layer): softmax weight on position 0, averaged over
    heads and over query positions > 64.
  * BOS activation ratio (per layer): max |hidden| at position 0 / median over positions of
    max |hidden| (the "massive activation" that usually comes with attention sinks).

    python train/model_stats.py --model oscar_compile/bundled/oscar-tiny-qwen3 --device cuda
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch


def load_needle_module():
    """Import oscar_compile/data/needle.py by path: training must not depend on the rest of
    the package (other parts of the repo may be mid-change when the GPU run is made)."""
    import importlib.util

    name = "oscar_needle"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "oscar_compile" / "data" / "needle.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


needle = load_needle_module()


def load(model_dir: str, device: str, dtype=torch.bfloat16, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn,
                                                 use_kernels=False)
    return model.to(device).eval(), tok


def token_bytes(tok) -> np.ndarray:
    """Bytes each token id stands for (byte-level BPE: one char of the token string per byte)."""
    special = set(tok.all_special_ids)
    toks = tok.convert_ids_to_tokens(list(range(len(tok))))
    return np.array([0 if i in special else len(t) for i, t in enumerate(toks)], dtype=np.int64)


@torch.no_grad()
def heldout_ppl(model, ids: np.ndarray, bos: int, ctx: int, n_windows: int | None = None,
                batch: int = 16, tbytes: np.ndarray | None = None) -> dict:
    step = ctx - 1
    n = len(ids) // step if n_windows is None else min(n_windows, len(ids) // step)
    dev = next(model.parameters()).device
    nll, count, nbytes = 0.0, 0, 0
    for i in range(0, n, batch):
        rows = [np.concatenate([[bos], ids[j * step:(j + 1) * step]]) for j in range(i, min(n, i + batch))]
        x = torch.from_numpy(np.stack(rows).astype(np.int64)).to(dev)
        logits = model(x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1),
                                                 reduction="sum")
        nll += loss.item()
        count += x[:, 1:].numel()
        if tbytes is not None:
            nbytes += int(tbytes[x[:, 1:].cpu().numpy()].sum())
    out = {"ctx": ctx, "windows": n, "tokens": count, "nll": nll / count, "ppl": math.exp(nll / count)}
    if tbytes is not None:
        out["bytes"] = nbytes
        out["bits_per_byte"] = nll / math.log(2) / nbytes
    return out


@torch.no_grad()
def needle_accuracy(model, tok, haystack: np.ndarray, length: int, n: int, *, seed: int,
                    fmt: str = "plain", n_distractors: int = 0, batch: int = 16, bins: int = 5) -> dict:
    """Accuracy over n samples with random depths (seeded), plus accuracy per depth bin."""
    dev = next(model.parameters()).device
    samples = list(_random_depth_samples(tok, haystack, length, n, seed, fmt, n_distractors))
    ok = []
    for i in range(0, n, batch):
        chunk = samples[i:i + batch]
        full = [s.input_ids + s.answer_ids[:-1] for s in chunk]
        width = max(map(len, full))
        x = torch.full((len(full), width), tok.pad_token_id, dtype=torch.long)
        for r, f in enumerate(full):
            x[r, :len(f)] = torch.tensor(f)
        pred = model(x.to(dev)).logits.argmax(-1).cpu()
        for r, s in enumerate(chunk):
            a = len(s.answer_ids)
            ok.append(pred[r, s.length - 1:s.length - 1 + a].tolist() == s.answer_ids)
    by_bin = [[] for _ in range(bins)]
    for s, good in zip(samples, ok, strict=True):
        by_bin[min(int(s.depth * bins), bins - 1)].append(good)
    return {"length": length, "n": n, "fmt": fmt, "distractors": n_distractors,
            "accuracy": float(np.mean(ok)),
            "accuracy_by_depth_bin": [float(np.mean(b)) if b else None for b in by_bin]}


def _random_depth_samples(tok, haystack, length, n, seed, fmt, n_distractors):
    tk = needle.TokenAdapter(tok)
    for k in range(n):
        yield needle.make_needle_sample(tok, haystack, length, depth=None, seed=seed * 100_003 + k,
                                 fmt=fmt, n_distractors=n_distractors, with_text=False, tok=tk)


def _layer_keys_values(cache, i):
    if hasattr(cache, "layers"):
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]


@torch.no_grad()
def kv_stats(model_dir: str, device: str, ids: np.ndarray, bos: int, ctx: int = 4096,
             n_windows: int = 2, dtype=torch.bfloat16) -> dict:
    """Per-layer key/value channel outliers, first-token attention mass, BOS activation ratio."""
    model, _ = load(model_dir, device, dtype=dtype, attn="eager")
    step = ctx - 1
    n_windows = min(n_windows, len(ids) // step)
    L = model.config.num_hidden_layers
    kabs = [0.0] * L
    vabs = [0.0] * L
    sink = np.zeros(L)
    bos_ratio = np.zeros(L)
    for j in range(n_windows):
        x = torch.from_numpy(np.concatenate([[bos], ids[j * step:(j + 1) * step]]).astype(np.int64))[None].to(device)
        out = model(x, use_cache=True, output_attentions=True, output_hidden_states=True)
        for i in range(L):
            # [1, kv, T, d], post-RoPE
            k, v = _layer_keys_values(out["cache"] if "cache" in out else out.past_key_values, i)
            kabs[i] = kabs[i] + k[0].float().abs().mean(1)             # [kv, d]
            vabs[i] = vabs[i] + v[0].float().abs().mean(1)
            a = out.attentions[i][0].float()                           # [H, T, T]
            sink[i] += a[:, 65:, 0].mean().item()
            h = out.hidden_states[i + 1][0].float().abs().amax(-1)     # [T]
            bos_ratio[i] += (h[0] / h[1:].median()).item()
        del out
    layers = []
    for i in range(L):
        km, vm = kabs[i] / n_windows, vabs[i] / n_windows
        kr = km.amax(1) / km.mean(1)
        vr = vm.amax(1) / vm.mean(1)
        head = int(kr.argmax())
        layers.append({
            "layer": i,
            "key_outlier_ratio": float(kr.max()), "key_outlier_head": head,
            "key_outlier_channel": int(km[head].argmax()),
            "key_outlier_ratio_mean_over_heads": float(kr.mean()),
            "value_outlier_ratio": float(vr.max()),
            "first_token_attention_mass": float(sink[i] / n_windows),
            "bos_activation_ratio": float(bos_ratio[i] / n_windows),
        })
    return {"ctx": ctx, "windows": n_windows, "layers": layers}


def evaluate(model_dir: str, heldout_path: str, device: str, *, needle_n: int = 300,
             needle_lengths=(1024, 2048, 4096), ppl_ctx: int = 4096, deadline: float | None = None,
             ppl_windows: int | None = None, log=print) -> dict:
    """Full evaluation used by train.py after training and by the CLI."""
    t0 = time.time()
    model, tok = load(model_dir, device)
    ids = np.fromfile(heldout_path, dtype=np.uint16)
    bos = tok.bos_token_id
    tb = token_bytes(tok)
    res: dict = {"heldout_tokens": int(ids.size)}
    res["ppl"] = heldout_ppl(model, ids, bos, ppl_ctx, n_windows=ppl_windows, tbytes=tb)
    log("ppl", res["ppl"])
    res["ppl_512"] = heldout_ppl(model, ids, bos, 512, n_windows=ppl_windows, tbytes=tb, batch=64)
    res["test_slice"] = heldout_ppl(model, ids, bos, 512, n_windows=4, tbytes=tb)
    log("ppl_512", res["ppl_512"]["ppl"], "test_slice", res["test_slice"]["ppl"])
    res["needle"] = []
    plan = [(L, "plain", 0, needle_n) for L in needle_lengths]
    plan += [(needle_lengths[-1], "plain", 2, max(needle_n // 2, 8)),
             (needle_lengths[-1], "chat", 0, max(needle_n // 2, 8))]
    for k, (L, fmt, nd, n) in enumerate(plan):
        if deadline is not None and time.time() > deadline:
            log("needle eval stopped by deadline")
            break
        r = needle_accuracy(model, tok, ids, L, n, seed=1000 + k, fmt=fmt, n_distractors=nd)
        res["needle"].append(r)
        log("needle", r)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    if deadline is None or time.time() < deadline:
        res["kv_stats"] = kv_stats(model_dir, device, ids, bos, ctx=min(ppl_ctx, 4096))
        for row in res["kv_stats"]["layers"]:
            log("kv", row)
    res["eval_seconds"] = time.time() - t0
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="oscar_compile/bundled/oscar-tiny-qwen3")
    ap.add_argument("--heldout", default=None, help="defaults to <model>/heldout.bin")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--needle-n", type=int, default=300)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--out", default=None, help="write the results JSON here")
    args = ap.parse_args()
    heldout = args.heldout or str(Path(args.model) / "heldout.bin")
    lengths = tuple(x for x in (1024, 2048, 4096) if x <= args.ctx) or (args.ctx,)
    res = evaluate(args.model, heldout, args.device, needle_n=args.needle_n,
                   needle_lengths=lengths, ppl_ctx=args.ctx)
    text = json.dumps(res, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
