"""A tiny model folder shaped like the bundled one, for tests and the CI slice of ``oscar-compile eval``.

``write_tiny_model_dir(path)`` saves a random Qwen3 (head_dim 128, so the shipped specs apply),
a byte-level tokenizer with the needle layout's special tokens, and disjoint ``heldout.bin`` /
``calib.bin`` token files (random byte tokens, uint16). No download.

    python -m oscar_compile.evaluation.fixtures /tmp/tiny && \\
    python -m oscar_compile.evaluation --model /tmp/tiny --context 512 --num-samples 2 ...
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

SPECIAL = ("<|endoftext|>", "<|startoftext|>", "<|im_start|>", "<|im_end|>")


def byte_tokenizer(bos: str | None = SPECIAL[1], extra_special: tuple[str, ...] = ()):
    """A ``PreTrainedTokenizerFast``: one token per byte (ids 0..255), then the four specials.

    ``bos``: the BOS token (default ``<|startoftext|>``, the bundled convention; a token not in
    SPECIAL, e.g. Llama's ``<s>``, goes to ``extra_special``); None builds a tokenizer without a
    BOS, as most Qwen tokenizers are.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    specials = list(SPECIAL) + list(extra_special)
    for tok in specials:
        vocab[tok] = len(vocab)
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=SPECIAL[0],
                                   pad_token=SPECIAL[0])


def write_tiny_model_dir(path: str | Path, num_layers: int = 2, heldout_tokens: int = 16384,
                         calib_tokens: int = 8192, seed: int = 0, tokenizer=None) -> Path:
    """Write config, weights, tokenizer, heldout.bin and calib.bin under ``path``; returns it.

    ``tokenizer``: default :func:`byte_tokenizer`; the config's ``bos_token_id`` is its BOS (or None).
    """
    from oscar_compile.testing import tiny_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer if tokenizer is not None else byte_tokenizer()
    model = tiny_model("qwen3", num_layers=num_layers, num_heads=2, num_kv_heads=1, head_dim=128,
                       vocab_size=len(tokenizer), seed=seed)
    model.config.bos_token_id = tokenizer.bos_token_id
    model.config.eos_token_id = model.config.pad_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    rng = np.random.default_rng(seed)
    rng.integers(0, 256, heldout_tokens, dtype=np.uint16).astype("<u2").tofile(path / "heldout.bin")
    rng.integers(0, 256, calib_tokens, dtype=np.uint16).astype("<u2").tofile(path / "calib.bin")
    return path


if __name__ == "__main__":
    print(write_tiny_model_dir(sys.argv[1] if len(sys.argv) > 1 else "tiny-eval-model"))
