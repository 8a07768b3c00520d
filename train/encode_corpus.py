"""Tokenize the corpus splits into flat uint16 token files, and cut the shipped slices.

Why flat uint16 streams: training samples random 4096-token windows, so a memory-mapped
array of token ids (documents joined by ``<|endoftext|>``) is all it needs, and uint16
fits the 8192-entry vocabulary at two bytes a token. Documents are shuffled with a fixed
seed so a window's neighbouring documents come from different packages.

Literal special-token strings inside source files (transformers' code contains
"<|endoftext|>") are encoded as ordinary text: only the separators we insert are special.

Outputs in --out:
  train.u16, heldout.u16      full splits (stay in .work/, never committed)
  train.u16.xz                what the GPU run carries (the device has no corpus)
  heldout.bin                 first --heldout-tokens of the held-out stream (shipped)
  calib.bin                   --calib-tokens from training documents (shipped)
  meta.json                   counts and provenance

    python train/encode_corpus.py --corpus .work/corpus --tokenizer .work/tokenizer --out .work/tokens
"""
from __future__ import annotations

import argparse
import gzip
import json
import lzma
import random
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer


def load_docs(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def encode_docs(tok: Tokenizer, docs: list[dict], eos_id: int, batch: int = 2000) -> tuple[np.ndarray, list[int]]:
    """Return (stream, per-document token counts incl. the trailing EOS)."""
    parts, counts = [], []
    for i in range(0, len(docs), batch):
        encs = tok.encode_batch([d["text"] for d in docs[i:i + batch]], add_special_tokens=False)
        for e in encs:
            ids = e.ids + [eos_id]
            parts.append(np.asarray(ids, dtype=np.uint16))
            counts.append(len(ids))
    return np.concatenate(parts), counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=".work/corpus")
    ap.add_argument("--tokenizer", default=".work/tokenizer")
    ap.add_argument("--out", default=".work/tokens")
    ap.add_argument("--heldout-tokens", type=int, default=1 << 20)
    ap.add_argument("--calib-tokens", type=int, default=1 << 18)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--xz-preset", type=int, default=9)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    tok.encode_special_tokens = True
    eos_id = tok.token_to_id("<|endoftext|>")
    assert tok.get_vocab_size() <= 65535

    meta: dict = {"tokenizer_vocab": tok.get_vocab_size(), "seed": args.seed}
    rng = random.Random(args.seed)
    for split in ("train", "heldout"):
        docs = load_docs(Path(args.corpus) / f"{split}.jsonl.gz")
        rng.shuffle(docs)
        stream, counts = encode_docs(tok, docs, eos_id)
        stream.tofile(out / f"{split}.u16")
        n_bytes = sum(len(d["text"].encode()) for d in docs)
        by_source: dict[str, int] = {}
        for d, c in zip(docs, counts, strict=True):
            by_source[d["source"]] = by_source.get(d["source"], 0) + c
        meta[split] = {"docs": len(docs), "tokens": int(stream.size), "text_bytes": n_bytes,
                       "bytes_per_token": n_bytes / stream.size, "tokens_by_source": by_source}
        print(split, meta[split])
        if split == "heldout":
            assert stream.size >= args.heldout_tokens, "held-out split too small"
            stream[:args.heldout_tokens].tofile(out / "heldout.bin")
            meta["heldout_bin"] = {"tokens": args.heldout_tokens,
                                   "from": "start of the shuffled held-out stream"}
        else:
            # Calibration: a separate seeded draw of whole training documents.
            order = list(range(len(docs)))
            random.Random(args.seed + 1).shuffle(order)
            starts = np.concatenate([[0], np.cumsum(counts)])
            picked, n = [], 0
            for j in order:
                picked.append(stream[starts[j]:starts[j + 1]])
                n += counts[j]
                if n >= args.calib_tokens:
                    break
            np.concatenate(picked)[:args.calib_tokens].tofile(out / "calib.bin")
            meta["calib_bin"] = {"tokens": args.calib_tokens, "docs": len(picked),
                                 "from": "random whole training documents (seed+1)"}
            with lzma.open(out / "train.u16.xz", "wb", preset=args.xz_preset) as f:
                f.write(stream.tobytes())
            meta["train_xz_bytes"] = (out / "train.u16.xz").stat().st_size
            print("train.u16.xz MB", meta["train_xz_bytes"] / 1e6)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
