"""Train the byte-level BPE tokenizer of oscar-tiny-qwen3 on the training split only.

Why byte-level BPE with a custom split regex: byte-level means any text round-trips
(code has every odd character), and splitting numbers into groups of at most three
digits makes the needle values (random 6-digit numbers) tokenize the same way
wherever they occur, which is what a retrieval test needs.

Special tokens: ``<|endoftext|>`` (eos/pad, separates documents), ``<|startoftext|>``
(bos, starts every training window: gives the model one fixed first token, like real
LLMs, so attention sinks can form there), ``<|im_start|>``/``<|im_end|>`` (ChatML turns).

    python train/train_tokenizer.py --corpus .work/corpus --out .work/tokenizer
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS, BOS, IM_START, IM_END = "<|endoftext|>", "<|startoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS, BOS, IM_START, IM_END]

# Contractions | a word with at most one leading non-letter | 1-3 digits |
# punctuation run (optional leading space, trailing newlines) | newline runs with their
# indentation | whitespace not followed by a non-space | any remaining whitespace.
SPLIT_PATTERN = (
    r"'(?:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML turns; with tools, the Hermes / Qwen2.5 tool format: the function signatures in a <tools>
# block of the system turn, calls as <tool_call> JSON, results as <tool_response> in a user turn.
CHAT_TEMPLATE = r"""{{- bos_token }}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments '
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n'
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' and message['tool_calls'] %}
        {{- '<|im_start|>assistant' }}
        {%- if message['content'] %}
            {{- '\n' + message['content'] }}
        {%- endif %}
        {%- for call in message['tool_calls'] %}
            {%- set function = call['function'] if call['function'] is defined else call %}
            {{- '\n<tool_call>\n{"name": ' + (function['name'] | tojson) + ', "arguments": ' }}
            {%- if function['arguments'] is string %}
                {{- function['arguments'] }}
            {%- else %}
                {{- function['arguments'] | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif not (tools and loop.first and message['role'] == 'system') %}
        {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""


def iter_texts(corpus: Path, max_bytes: int):
    used = 0
    with gzip.open(corpus / "train.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            used += len(text)
            yield text
            if used >= max_bytes:
                return


def build_tokenizer(vocab_size: int, texts) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Plain encode prepends BOS like training windows; chat templates add it themselves
    # (transformers renders templates and tokenizes with add_special_tokens=False).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def save_for_transformers(tok: Tokenizer, out: Path, model_max_length: int) -> None:
    """Write tokenizer.json + tokenizer_config.json loadable by AutoTokenizer offline."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS,
        additional_special_tokens=[IM_START, IM_END], model_max_length=model_max_length,
        clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(out))
    # Portable config: transformers 5 writes its own class name ("TokenizersBackend") and a
    # separate chat_template.jinja; 4.x reads neither. The generic class name plus an inline
    # chat_template loads in both.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["additional_special_tokens"] = [IM_START, IM_END]
    cfg["extra_special_tokens"] = [IM_START, IM_END]
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=".work/corpus")
    ap.add_argument("--out", default=".work/tokenizer")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--max-bytes", type=int, default=10**12, help="train on a prefix only (tests)")
    ap.add_argument("--model-max-length", type=int, default=4096)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(args.vocab_size, iter_texts(Path(args.corpus), args.max_bytes))
    save_for_transformers(tok, out, args.model_max_length)
    print("vocab", tok.get_vocab_size(), "specials", [tok.token_to_id(s) for s in SPECIAL_TOKENS])


if __name__ == "__main__":
    main()
