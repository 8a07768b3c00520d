"""A byte-level BPE tokenizer of Qwen3's vocabulary size (151,936), trained offline on local text.

The grammar engines' costs (compile, mask fill) grow with the vocabulary and with what its tokens
spell, so the structured-output benchmarks need a tokenizer of the size a served model has. None
ships with the project and nothing may be downloaded, so this trains one with ``tokenizers`` on
the sources at hand: the Python standard library's ``*.py``, then the installed packages'
(``site-packages``, sorted), up to 150 MB of text (~75 s on 2 cores), and caches it as
``tokenizer.json`` with a ``report.json``. The corpus depends on what is installed, so two machines
may train different merges; the size is what the benchmarks need.

Byte-level BPE (GPT-2's pre-tokenizer and byte alphabet, as Qwen's) stops merging when no pair is
seen twice; 150 MB of code gives the full 151,936 here (the stdlib alone gives ~78k). If merges ever
run short, the rest is padded with ordinary (non-special) tokens spelling ``"<pad_NNNNNN>"``, so
the id space is exactly Qwen3's; those are valid inside a JSON string, as a real vocabulary's rare
words are, so the engines still look at them. ``pad`` in the report says how many there are.

    python -m oscar_compile.bench.bpe_tokenizer [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

QWEN3_VOCAB_SIZE = 151_936
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MAX_CORPUS_BYTES = 150_000_000
DEFAULT_DIR = Path.home() / ".cache" / "oscar_compile" / "bpe-151936"


def _corpus_texts(max_bytes: int = MAX_CORPUS_BYTES):
    """The standard library's sources, then the installed packages' (``site-packages``), in
    sorted order, up to ``max_bytes``; files that are not UTF-8 (codec test data) are skipped."""
    paths = sysconfig.get_paths()
    stdlib, site = Path(paths["stdlib"]), Path(paths["purelib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts) + sorted(site.rglob("*.py"))
    total = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        total += len(text)
        if total > max_bytes:
            return
        yield text


def train(out_dir: Path = DEFAULT_DIR, vocab_size: int = QWEN3_VOCAB_SIZE) -> dict:
    """Train (or reuse the cached) tokenizer; returns ``{"path", "trained", "pad", "seconds"}``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    report_path = out_dir / "report.json"
    if path.exists() and report_path.exists():
        return json.loads(report_path.read_text())
    start = time.perf_counter()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_texts(), trainer)
    trained = tokenizer.get_vocab_size()
    num_pad = vocab_size - trained
    tokenizer.add_tokens([f"<pad_{i:06d}>" for i in range(num_pad)])
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"padded vocabulary has {tokenizer.get_vocab_size()} tokens, not {vocab_size}")
    tokenizer.save(str(path))
    report = {"path": str(path), "trained": trained, "pad": num_pad, "seconds": time.perf_counter() - start}
    report_path.write_text(json.dumps(report, indent=1))
    return report


def load(out_dir: Path = DEFAULT_DIR):
    """The tokenizer as a transformers ``PreTrainedTokenizerFast`` (EOS ``<|endoftext|>``)."""
    from transformers import PreTrainedTokenizerFast

    report = train(out_dir)
    return PreTrainedTokenizerFast(tokenizer_file=report["path"], eos_token="<|endoftext|>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR)
    print(json.dumps(train(parser.parse_args().out)))


if __name__ == "__main__":
    main()
