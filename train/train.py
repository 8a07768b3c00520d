"""Train oscar-tiny-qwen3 on one GPU within a wall-clock budget, then save and evaluate it.

Why wall-clock driven: the run gets a single short GPU lease, so the learning-rate
schedule is a cosine over *elapsed time* (after a step-count warmup) that ends exactly at
``--train-until`` seconds after start; the remaining time saves the HF checkpoint and runs
``model_stats.evaluate``. Files land in ``--out`` in the shape the lease returns best:
the safetensors shards, ``meta.tar`` (config, index, eval and training logs).

Batches (built by a background thread so the GPU never waits):
  * a text window: ``<|startoftext|>`` + 4096 consecutive tokens at a random offset of the
    training stream (documents joined by ``<|endoftext|>``); BOS always first, so the
    model can form an attention sink there as large models do;
  * with probability ``--needle-frac`` a needle document instead (prompt length uniform in
    128..4096, plain or chat layout, 0-3 distractor facts, haystack from the training
    stream) whose answer and reply end are trained on, the rest of the window filled with
    BOS + text.

    python train/train.py --data .work/carry --out $OUT            # GPU run
    python train/train.py --data .work/carry --out /tmp/smoke --smoke   # CPU check
"""
from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import queue
import shutil
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from model_stats import evaluate, needle  # noqa: E402
from tiny_qwen3 import TinyQwen3, TinyQwen3Config, to_hf  # noqa: E402

T_START = time.time()


def log(*a) -> None:
    print(f"[{time.time() - T_START:7.1f}s]", *a, flush=True)


def load_stream(data: Path) -> np.ndarray:
    raw = data / "train.u16"
    if raw.exists():
        return np.fromfile(raw, dtype=np.uint16)
    with lzma.open(data / "train.u16.xz", "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint16)


class BatchMaker(threading.Thread):
    """Produces pinned (B, T+1) int64 token windows into a bounded queue."""

    def __init__(self, stream, tok, batch, seq, needle_frac, seed, min_needle=128):
        super().__init__(daemon=True)
        self.stream, self.batch, self.seq, self.frac = stream, batch, seq, needle_frac
        self.tk = needle.TokenAdapter(tok)
        self.tok = tok
        self.rng = np.random.default_rng(seed)
        self.min_needle = min(min_needle, seq // 2)
        self.q: queue.Queue = queue.Queue(maxsize=6)
        self.stop = False
        self.needles = 0

    def text_into(self, row: np.ndarray) -> None:
        off = int(self.rng.integers(0, len(self.stream) - len(row)))
        row[:] = self.stream[off:off + len(row)]

    def window_into(self, row: np.ndarray) -> None:
        """Fill one (T+1)-token row: a text window, or a needle document + BOS + text."""
        n = len(row)
        row[0] = self.tk.bos
        if self.rng.random() >= self.frac:
            self.text_into(row[1:])
            return
        length = int(self.rng.integers(self.min_needle, n - 24 + 1))
        fmt = "chat" if self.rng.random() < 0.5 else "plain"
        nd = int(self.rng.choice([0, 0, 0, 1, 2, 3]))
        seed = int(self.rng.integers(0, 2**31 - 1))
        try:
            s = needle.make_needle_sample(self.tok, self.stream, length, seed=seed, fmt=fmt,
                                          n_distractors=nd, with_text=False, tok=self.tk)
        except ValueError:  # too short for this many distractors
            s = needle.make_needle_sample(self.tok, self.stream, max(length, 160), seed=seed,
                                          fmt="plain", with_text=False, tok=self.tk)
        self.needles += 1
        doc = (s.input_ids + s.completion_ids)[:n]
        row[:len(doc)] = doc
        rest = n - len(doc)
        if rest == 1:
            row[-1] = self.tk.eos
        elif rest > 1:
            row[len(doc)] = self.tk.bos
            self.text_into(row[len(doc) + 1:])

    def make(self) -> torch.Tensor:
        arr = np.empty((self.batch, self.seq + 1), dtype=np.int64)
        for r in range(self.batch):
            self.window_into(arr[r])
        t = torch.from_numpy(arr)
        return t.pin_memory() if torch.cuda.is_available() else t

    def run(self) -> None:
        while not self.stop:
            b = self.make()
            while not self.stop:
                try:
                    self.q.put(b, timeout=0.5)
                    break
                except queue.Full:
                    pass


def param_groups(model: torch.nn.Module, wd: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() == 2 and "embed_tokens" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=".work/carry", help="train.u16[.xz], heldout.bin, tokenizer/")
    ap.add_argument("--out", default=os.environ.get("OUT", ".work/run"))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--needle-frac", type=float, default=0.3)
    ap.add_argument("--train-until", type=float, default=440.0, help="seconds after start when training stops")
    ap.add_argument("--eval-until", type=float, default=555.0, help="seconds after start when eval gives up")
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--needle-n", type=int, default=300)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run of the whole pipeline")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.smoke:
        args.seq, args.batch, args.warmup = 256, 2, 2
        args.max_steps = min(args.max_steps, 6)
        args.needle_n = 8
        args.needle_frac = 0.5

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    data, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log("torch", torch.__version__, "device", torch.cuda.get_device_name() if dev == "cuda" else "cpu", vars(args))

    import transformers
    from transformers import AutoTokenizer
    log("transformers", transformers.__version__)
    tok = AutoTokenizer.from_pretrained(str(data / "tokenizer"))
    stream = load_stream(data)
    log(f"train stream {stream.size / 1e6:.1f}M tokens")

    cfg = TinyQwen3Config(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.inter,
                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                          num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
    model = TinyQwen3(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"params {n_params / 1e6:.2f}M ({2 * n_params / 1e6:.1f} MB bf16)")
    opt = torch.optim.AdamW(param_groups(model, args.wd), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            **({"fused": True} if dev == "cuda" else {}))
    if not args.no_compile:
        # Regional compilation: every decoder layer has the same code and shapes, so one
        # compiled graph serves all of them (cold start ~ one layer, not the whole stack).
        for layer in model.model.layers:
            layer.compile()
        model.head_loss = torch.compile(model.head_loss)
    step_fn = model

    maker = BatchMaker(stream, tok, args.batch, args.seq, args.needle_frac, seed=args.seed + 1)
    maker.start()
    hist, step, tokens = [], 0, 0
    loss_acc = torch.zeros((), device=dev)
    t_clock = None  # set after the first (compiling) step
    deadline = T_START + args.train_until
    last_t, last_tokens = time.time(), 0
    try:
        while step < args.max_steps:
            now = time.time()
            if now >= deadline:
                break
            if t_clock is None:
                progress = 0.0
            else:
                progress = min(1.0, (now - t_clock) / max(deadline - t_clock, 1e-6))
            warm = min(1.0, (step + 1) / args.warmup)
            lr = args.lr * warm * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))
            for g in opt.param_groups:
                g["lr"] = lr
            batch = maker.q.get().to(dev, non_blocking=True)
            try:
                with torch.autocast(device_type=dev, dtype=torch.bfloat16):
                    loss = step_fn(batch[:, :-1], batch[:, 1:])
                loss.backward()
            except Exception as exc:  # a compiler failure must not cost the whole lease
                if t_clock is not None or args.no_compile:
                    raise
                log(f"compiled first step failed ({type(exc).__name__}: {exc}); continuing eager")
                args.no_compile = True
                for layer in model.model.layers:
                    layer._compiled_call_impl = None
                model.head_loss = TinyQwen3.head_loss.__get__(model)
                opt.zero_grad(set_to_none=True)
                continue
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_acc += loss.detach()
            step += 1
            tokens += batch[:, 1:].numel()
            if t_clock is None:
                if dev == "cuda":
                    torch.cuda.synchronize()
                t_clock = time.time()
                log(f"first step (compile) done, loss {loss.item():.3f}")
                loss_acc.zero_()
                last_t, last_tokens = t_clock, tokens
                continue
            if step % 25 == 0 or args.smoke:
                avg_loss = (loss_acc / (25 if not args.smoke else 1)).item()
                loss_acc.zero_()
                t = time.time()
                tps = (tokens - last_tokens) / (t - last_t)
                last_t, last_tokens = t, tokens
                hist.append({"step": step, "loss": avg_loss, "lr": lr, "gnorm": float(gnorm), "tokens": tokens,
                             "tok_per_s": tps, "t": t - T_START})
                log(f"step {step} loss {avg_loss:.4f} lr {lr:.2e} gnorm {float(gnorm):.2f} tok/s {tps / 1e3:.0f}k "
                    f"tokens {tokens / 1e6:.1f}M epochs {tokens / stream.size:.2f} q={maker.q.qsize()}")
                if not math.isfinite(avg_loss):
                    log("non-finite loss: stopping")
                    break
    finally:
        maker.stop = True
    train_seconds = time.time() - (t_clock or time.time())
    log(f"training done: {step} steps, {tokens / 1e6:.1f}M tokens, {train_seconds:.0f}s after compile, "
        f"{maker.needles} needle docs")

    # Save the shipped form: bf16 HF checkpoint in <=14 MB shards, tokenizer beside it.
    model_dir = Path("/tmp/oscar-tiny-qwen3") if not args.smoke else out / "model"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    hf = to_hf(model.cpu().float(), torch.bfloat16)
    hf.generation_config.bos_token_id = tok.bos_token_id
    hf.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    hf.generation_config.pad_token_id = tok.pad_token_id
    hf.save_pretrained(str(model_dir), max_shard_size="14MB")
    tok.save_pretrained(str(model_dir))
    train_log = {"config": vars(args), "params": n_params, "steps": step, "tokens": tokens,
                 "train_stream_tokens": int(stream.size), "epochs": tokens / stream.size,
                 "train_seconds_after_compile": train_seconds, "needle_docs": maker.needles,
                 "wall_seconds_total_at_save": time.time() - T_START, "history": hist,
                 "torch": torch.__version__, "transformers": transformers.__version__,
                 "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}
    (model_dir / "train_log.json").write_text(json.dumps(train_log, indent=1))
    pack(model_dir, out)
    log("saved", sorted(p.name for p in model_dir.iterdir()))

    res = evaluate(str(model_dir), str(data / "heldout.bin"), dev, needle_n=args.needle_n,
                   needle_lengths=(1024, 2048, 4096) if args.seq >= 4096 else (args.seq // 2, args.seq),
                   ppl_ctx=args.seq, deadline=T_START + args.eval_until,
                   ppl_windows=8 if args.smoke else None, log=log)
    (model_dir / "eval.json").write_text(json.dumps(res, indent=1))
    pack(model_dir, out)
    log("all done")


def pack(model_dir: Path, out: Path) -> None:
    """Shards go to --out as they are; everything small goes into one meta.tar."""
    if model_dir.resolve() == (out / "model").resolve():
        return
    with tarfile.open(out / "meta.tar", "w") as tar:
        for p in sorted(model_dir.iterdir()):
            if p.suffix == ".safetensors":
                shutil.copy(p, out / p.name)
            elif not p.name.startswith("tokenizer") and p.name != "chat_template.jinja":
                tar.add(p, arcname=p.name)


if __name__ == "__main__":
    main()
