"""A seeded generator of malformed and out-of-range requests for every server route.

Each case is (method, path, raw body bytes, headers). Mutations start from a valid body and
break one to a few fields: wrong JSON types, extreme numbers (2**64, 1e308, NaN, Infinity),
unicode and control characters (NUL, RTL marks, lone surrogates, emoji), huge strings and lists,
deep nesting; or break the body itself (not JSON, truncated, invalid UTF-8, not an object,
over the size limit); or use a wrong method or an unknown path. The same seed gives the same
cases, so a failure can be replayed from the seed and the case index it reports.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

COMMON_FIELDS = ["model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
                 "seed", "presence_penalty", "frequency_penalty", "logit_bias", "user", "metadata", "store",
                 "service_tier", "top_k", "ignore_eos", "stop_token_ids", "skip_special_tokens",
                 "repetition_penalty", "min_p", "min_tokens"]
COMPLETION_FIELDS = COMMON_FIELDS + ["prompt", "logprobs", "echo", "best_of", "suffix"]
CHAT_FIELDS = COMMON_FIELDS + ["messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                               "tool_choice", "parallel_tool_calls", "response_format"]
UNKNOWN_FIELDS = ["max_token", "functions", "", "\u0000", "a" * 200, "prompt ", "Messages", "min_token"]
ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
          ("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models/tiny"), ("GET", "/version"),
          ("GET", "/tokenizer_info"), ("POST", "/tokenize"), ("POST", "/detokenize")]
ODD_PATHS = ["/v1/nope", "/v1", "/", "/v1/completions/", "/v1//completions", "/v1/chat/completions%00",
             "/v1/models/tiny", "/%ff%fe", "/v1/completions?x=%00&y=%C3%A9",
             "/v1/" + "a" * 3000]
INTS = [0, 1, -1, 2, 5, 7, 20, 21, 100, 513, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1,
        10**30, -(10**30)]
FLOATS = [0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 2.0000001, -0.5, 1e-300, 5e-324, 1e300, -1e300, 1.7976931348623157e308,
          float("nan"), float("inf"), float("-inf")]
CHAR_POOLS = ["\x00\x01\x07\x08\t\n\r\x0b\x0c\x1b\x1f\x7f", "\u200b\u200e\u200f\u202a\u202e\u2066\ufeff\ufffd\uffff",
              "é日本語한국어العربية", "🙂👩‍👩‍👧‍👦🏳️‍🌈", "a\u0301\u0302\u0303", "\ud800\udbff\udc00\udfff",
              "<|endoftext|><|im_start|><|im_end|>", "abc xyz ", "\"\\/{}[]:,"]


@dataclass
class Case:
    index: int
    method: str
    path: str
    body: bytes | None
    headers: dict[str, str]
    kind: str

    def describe(self) -> str:
        body = self.body[:300] if self.body is not None else None
        return f"case {self.index} ({self.kind}): {self.method} {self.path[:80]} body={body!r}"


class BodyFuzzer:
    def __init__(self, seed: int, model: str, max_body_bytes: int):
        self.rng = random.Random(seed)
        self.model = model
        self.max_body_bytes = max_body_bytes

    # ---- values -----------------------------------------------------------------------------
    def text(self, max_len: int = 40) -> str:
        pool = self.rng.choice(CHAR_POOLS)
        return "".join(self.rng.choice(pool) for _ in range(self.rng.randint(0, max_len)))

    def value(self, depth: int = 0):
        r = self.rng.random()
        if r < 0.10:
            return self.rng.choice([None, True, False])
        if r < 0.28:
            return self.rng.choice(INTS)
        if r < 0.42:
            return self.rng.choice(FLOATS)
        if r < 0.62:
            return self.rng.choice([self.text(), self.text(), "", "5", "true", "null",
                                    "x" * self.rng.randint(1000, 20000)])
        if r < 0.80 and depth < 3:
            return [self.value(depth + 1) for _ in range(self.rng.choice([0, 1, 2, 5]))]
        if r < 0.88:
            return [self.rng.randint(-5, 500) for _ in range(self.rng.choice([1, 3, 600, 5000]))]
        if depth < 3:
            return {self.rng.choice([self.text(8), "type", "text", "role", "content"]): self.value(depth + 1)
                    for _ in range(self.rng.randint(0, 3))}
        return {}

    def message(self):
        roles = ["system", "developer", "user", "assistant", "tool", "function", "robot", "", None, 3]
        message = {"role": self.rng.choice(roles)}
        r = self.rng.random()
        if r < 0.3:
            message["content"] = self.text()
        elif r < 0.5:
            message["content"] = [{"type": self.rng.choice(["text", "image_url", "input_audio", None]),
                                   "text": self.value()} for _ in range(self.rng.randint(0, 3))]
        elif r < 0.8:
            message["content"] = self.value()
        if self.rng.random() < 0.2:
            message[self.rng.choice(["name", "tool_call_id", "tool_calls", "refusal", "extra"])] = self.value()
        return message

    # ---- bodies -----------------------------------------------------------------------------
    def base(self, path: str) -> dict:
        body = {"model": self.model, "max_tokens": self.rng.randint(1, 3), "temperature": 0}
        if path == "/v1/completions":
            body["prompt"] = self.rng.choice(["hello", "fuzz", [5, 6, 7]])
        else:
            body["messages"] = [{"role": "user", "content": "hi"}]
        if self.rng.random() < 0.3:
            body["stream"] = True
        return body

    def mutated(self, path: str) -> dict:
        body = self.base(path)
        fields = COMPLETION_FIELDS if path == "/v1/completions" else CHAT_FIELDS
        for _ in range(self.rng.choice([1, 1, 1, 2, 3])):
            r = self.rng.random()
            if r < 0.1:
                body.pop(self.rng.choice(list(body) or ["model"]), None)
            elif r < 0.2:
                body[self.rng.choice(UNKNOWN_FIELDS)] = self.value()
            elif r < 0.35 and path == "/v1/chat/completions":
                body["messages"] = [self.message() for _ in range(self.rng.randint(0, 4))]
            else:
                body[self.rng.choice(fields)] = self.value()
        return body

    def raw(self, path: str) -> bytes:
        valid = json.dumps(self.base(path)).encode()
        choices = [
            lambda: valid[: self.rng.randint(0, len(valid) - 1)],  # truncated
            lambda: bytes(self.rng.getrandbits(8) for _ in range(self.rng.randint(1, 200))),
            lambda: b"",
            lambda: b"\xef\xbb\xbf" + valid,  # a BOM
            lambda: valid.replace(b"hi", b"\xff\xfe").replace(b"hello", b"\xc3\x28"),  # invalid UTF-8
            lambda: b"[" * 5000 + b"]" * 5000,
            lambda: b'{"prompt": ' + b"[" * 300 + b"1" + b"]" * 300 + b"}",
            lambda: b'{"prompt": "x", "max_tokens": 1e999999}',
            lambda: b'{"prompt": "x", "max_tokens": 3, "max_tokens": "dup"}',
            lambda: b'{"prompt": "x\\ud800", "max_tokens": 1}',
            lambda: b'{"prompt": "x", "temperature": NaN, "top_p": Infinity}',
            lambda: b" " * 3000 + valid + b" " * 3000,
            lambda: json.dumps(self.rng.choice([None, 1, "s", [1, 2], True, []])).encode(),
            lambda: valid + b" trailing",
            lambda: b'{"prompt": "' + b"y" * (self.max_body_bytes + self.rng.randint(1, 50000)) + b'"}',  # 413
        ]
        return self.rng.choice(choices)()

    def case(self, index: int) -> Case:
        headers = {"Content-Type": "application/json"}
        if self.rng.random() < 0.1:
            headers["Content-Type"] = self.rng.choice(["text/plain", "application/x-www-form-urlencoded", "",
                                                       "application/json; charset=latin-1"])
        if self.rng.random() < 0.05:
            headers["Authorization"] = self.rng.choice(["Bearer", "Bearer x", "Basic Zm9v", "\u00e9"]).encode(
                "utf-8").decode("latin-1")
        r = self.rng.random()
        if r < 0.08:  # the other routes, with a stray (completions) body or query
            method, path = self.rng.choice(ROUTES[2:])
            body = self.raw("/v1/completions") if self.rng.random() < 0.5 else None
            if self.rng.random() < 0.3:
                path += "?" + self.rng.choice(["x=1", "model=%00", "a" * 500])
            return Case(index, method, path, body, headers, "get-route")
        if r < 0.16:  # wrong method or unknown path
            method = self.rng.choice(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "POST"])
            path = self.rng.choice([p for _, p in ROUTES] + ODD_PATHS)
            return Case(index, method, path, self.raw("/v1/completions"), headers, "method-or-path")
        path = self.rng.choice(["/v1/completions", "/v1/chat/completions"])
        if r < 0.40:
            return Case(index, "POST", path, self.raw(path), headers, "raw")
        body = self.mutated(path)
        try:
            data = json.dumps(body).encode()
        except (ValueError, RecursionError):  # unreachable for the values above; keep the case count honest
            data = self.raw(path)
        return Case(index, "POST", path, data, headers, "mutated")

    def cases(self, num_cases: int) -> list[Case]:
        return [self.case(i) for i in range(num_cases)]
