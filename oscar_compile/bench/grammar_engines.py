"""xgrammar against llguidance on this CPU: what structured output costs the engine's host thread.

    python -m oscar_compile.bench.grammar_engines [--steps-repeat 5] [--out grammar_engines.json]

With a 151,936-token byte-level BPE (``bpe_tokenizer``: Qwen3's vocabulary size) and a JSON
schema of ten fields (``SCHEMA``), per engine:
- ``tokenizer_s``: building the engine's tokenizer view (once per server);
- ``compile_ms``: compiling the schema with no cache (once per distinct schema; llguidance builds
  its lexer lazily, so its first mask is counted here too);
- ``fill_us`` / ``advance_us``: one token-bitmask row fill and one token accepted, along the
  tokens of a valid compact instance (``INSTANCE``) then EOS, repeated ``--steps-repeat`` times
  (median and p99 over all steps);
- ``features``: which of the constraints the server exposes compile (regex, choice, a grammar,
  the JSON-schema keywords clients send). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from oscar_compile.evaluation.result_file import save_json

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "height_m": {"type": "number"},
        "is_member": {"type": "boolean"},
        "plan": {"enum": ["free", "pro", "team"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "email", "height_m", "is_member", "plan", "tags", "address", "nickname", "score"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@analytical.org",
    "height_m": 1.65,
    "is_member": True,
    "plan": "pro",
    "tags": ["math", "engines"],
    "address": {"city": "London", "zip": "W1"},
    "nickname": None,
    "score": 0.97,
}
FEATURES = {
    "regex": ("regex", r"\d{3}-[A-Z]{2}(x|y)+"),
    "choice": ("regex", "(positive|negative|neutral)"),
    "json_object": ("json", {"type": "object"}),
    "json_ref_defs": (
        "json",
        {
            "$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}}}},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/p"}},
        },
    ),
    "json_format_date": ("json", {"type": "string", "format": "date"}),
    "json_min_max_items": ("json", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}),
    "json_const_oneof": ("json", {"oneOf": [{"const": 1}, {"type": "string"}]}),
}
BATCH = 32  # the serving row's batch
EBNF = 'root ::= "yes" | "no" | num\nnum ::= [0-9]+'
LARK = 'start: "yes" | "no" | NUM\nNUM: /[0-9]+/'


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _walk(matcher_fill, matcher_accept, tokens: list[int], repeat: int, reset) -> dict:
    fills, advances = [], []
    for _ in range(repeat):
        reset()
        for token in tokens:
            t0 = time.perf_counter()
            matcher_fill()
            t1 = time.perf_counter()
            if not matcher_accept(token):
                raise RuntimeError(f"the engine refused token {token} of a valid instance")
            advances.append(time.perf_counter() - t1)
            fills.append(t1 - t0)
    us = 1e6
    return {
        "fill_us_mean": statistics.fmean(fills) * us,
        "fill_us_median": statistics.median(fills) * us,
        "fill_us_p99": _percentile(fills, 0.99) * us,
        "advance_us_mean": statistics.fmean(advances) * us,
        "advance_us_median": statistics.median(advances) * us,
        "advance_us_p99": _percentile(advances, 0.99) * us,
        "num_steps": len(fills),
    }


def bench_xgrammar(tokenizer, vocab_size: int, tokens: list[int], repeat: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    tokenizer_s = time.perf_counter() - t0
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compile_ms = (time.perf_counter() - t0) * 1e3
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    walk = _walk(
        lambda: matcher.fill_next_token_bitmask(bitmask, 0), matcher.accept_token, tokens, repeat, matcher.reset
    )
    if not matcher.is_terminated():
        raise RuntimeError("xgrammar did not terminate after EOS")
    features = {}
    for name, (kind, value) in FEATURES.items():
        features[name] = _try(
            lambda k=kind, v=value: (
                compiler.compile_regex(v)
                if k == "regex"
                else compiler.compile_json_schema(json.dumps(v), any_whitespace=False)
            )
        )
    features["ebnf"] = _try(lambda: compiler.compile_grammar(EBNF))
    features["lark"] = _try(lambda: compiler.compile_lark(LARK)) if hasattr(compiler, "compile_lark") else False
    batch = _xgrammar_batch_fill(xgr, compiled, vocab_size, tokens, repeat)
    return {"tokenizer_s": tokenizer_s, "compile_ms": compile_ms, **walk, **batch, "features": features}


def _xgrammar_batch_fill(xgr, compiled, vocab_size: int, tokens: list[int], repeat: int, batch: int = BATCH) -> dict:
    """One step of a batch: ``batch`` matchers spread over the instance's positions, their rows
    filled one by one and on xgrammar's thread pool (``BatchGrammarMatcher``, what the server runs)."""
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    for i, matcher in enumerate(matchers):
        for token in tokens[: i * (len(tokens) - 1) // batch]:
            matcher.accept_token(token)
    bitmask = xgr.allocate_token_bitmask(batch, vocab_size)
    pool = xgr.BatchGrammarMatcher()
    loop, threaded = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, row)
        t1 = time.perf_counter()
        pool.batch_fill_next_token_bitmask(matchers, bitmask)
        threaded.append(time.perf_counter() - t1)
        loop.append(t1 - t0)
    return {
        f"batch{batch}_fill_ms_loop": statistics.median(loop) * 1e3,
        f"batch{batch}_fill_ms_threaded": statistics.median(threaded) * 1e3,
    }


def bench_llguidance(tokenizer, vocab_size: int, tokens: list[int], repeat: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch
    from llguidance.gbnf_to_lark import gbnf_to_lark

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    tokenizer_s = time.perf_counter() - t0
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    )
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, grammar)
    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
    compile_ms = (time.perf_counter() - t0) * 1e3
    if matcher.is_error():
        raise RuntimeError(matcher.get_error())
    walk = _walk(
        lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0),
        matcher.consume_token,
        tokens,
        repeat,
        matcher.reset,
    )
    if not matcher.is_stopped():
        raise RuntimeError("llguidance did not stop after EOS")
    features = {}
    lark = llguidance.LLMatcher.grammar_from_lark
    for name, (kind, value) in FEATURES.items():
        features[name] = _ll_ok(
            lltok,
            lambda k=kind, v=value: (
                llguidance.LLMatcher.grammar_from_regex(v)
                if k == "regex"
                else llguidance.LLMatcher.grammar_from_json_schema(v)
            ),
        )
    features["ebnf"] = _ll_ok(lltok, lambda: lark(gbnf_to_lark(EBNF)))
    features["lark"] = _ll_ok(lltok, lambda: lark(LARK))
    return {"tokenizer_s": tokenizer_s, "compile_ms": compile_ms, **walk, "features": features}


def _ll_ok(lltok, make_grammar) -> bool:
    """llguidance reports a bad grammar on the matcher (``is_error``), not by raising."""
    import llguidance

    try:
        return not llguidance.LLMatcher(lltok, make_grammar()).is_error()
    except Exception:
        return False


def _try(compile_fn) -> bool:
    try:
        compile_fn()
    except Exception:
        return False
    return True


def main() -> None:
    from oscar_compile.bench import bpe_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps-repeat", type=int, default=5)
    parser.add_argument("--out", default="grammar_engines.json")
    args = parser.parse_args()
    tokenizer = bpe_tokenizer.load()
    vocab_size = bpe_tokenizer.QWEN3_VOCAB_SIZE
    text = json.dumps(INSTANCE, separators=(",", ":"))
    tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    results = {"vocab_size": vocab_size, "instance_tokens": len(tokens), "engines": {}}
    for name, bench in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        results["engines"][name] = bench(tokenizer, vocab_size, tokens, args.steps_repeat)
    print(f"vocab {vocab_size}, {len(tokens)} tokens per instance (EOS included)")
    print(
        f"{'engine':<11} {'tokenizer s':>11} {'compile ms':>10} {'fill us mean':>12} {'fill us p50':>11} "
        f"{'fill us p99':>11} {'adv us mean':>11} {'adv us p50':>10} {'adv us p99':>10}  features"
    )
    for name, r in results["engines"].items():
        missing = [f for f, ok in r["features"].items() if not ok]
        print(
            f"{name:<11} {r['tokenizer_s']:>11.2f} {r['compile_ms']:>10.1f} {r['fill_us_mean']:>12.1f} "
            f"{r['fill_us_median']:>11.1f} {r['fill_us_p99']:>11.1f} {r['advance_us_mean']:>11.1f} "
            f"{r['advance_us_median']:>10.1f} {r['advance_us_p99']:>10.1f}  "
            f"{'all' if not missing else 'missing ' + ', '.join(missing)}"
        )
    xg = results["engines"]["xgrammar"]
    print(
        f"xgrammar, one step of a batch of {BATCH} rows: {xg[f'batch{BATCH}_fill_ms_loop']:.2f} ms one by one, "
        f"{xg[f'batch{BATCH}_fill_ms_threaded']:.2f} ms on its thread pool"
    )
    save_json(results, args.out)


if __name__ == "__main__":
    main()
