"""Incremental detokenization and stop strings, one instance per request.

Decoding token by token breaks multi-byte characters and word-boundary spaces, and decoding the
whole output each step costs O(n) per token. We decode a short sliding window instead: the text
of ``ids[prefix:read]`` (already emitted) and of ``ids[prefix:]``; the difference is new text,
held back while it ends in U+FFFD (an incomplete UTF-8 sequence). The window starts with a few
prompt tokens so the first output token gets its leading space right.

Stop strings are searched in the new text plus the ``max_len - 1`` characters before it; a
match cuts the text before the stop string. While streaming, the last ``max_len - 1``
characters are held back so a client never sees the start of a stop string that later matches.
"""

from __future__ import annotations

_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | tuple = (),
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = list(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self.num_emitted_chars = 0
        self.matched_stop: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def append(self, token_id: int) -> bool:
        """Add one output token; True when a stop string just matched (the text is cut)."""
        if self.matched_stop is not None:
            return True
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return False
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._add_text(full_text[len(prefix_text):])

    def flush(self) -> None:
        """At the end: emit what an incomplete character held back (as U+FFFD)."""
        if self.matched_stop is not None or self._read_offset == len(self._ids):
            return
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        self._read_offset = len(self._ids)
        if len(full_text) > len(prefix_text):
            self._add_text(full_text[len(prefix_text):])

    def _add_text(self, new_text: str) -> bool:
        start = max(0, len(self.text) - self._hold)
        self.text += new_text
        if not self._stop:
            return False
        found = [(self.text.find(s, start), s) for s in self._stop]
        found = [(index, s) for index, s in found if index >= 0]
        if not found:
            return False
        index, self.matched_stop = min(found)
        self.text = self.text[:index]
        return True

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, keep back what could start a stop string."""
        end = len(self.text)
        if not finished and self._stop:
            end = max(self.num_emitted_chars, end - self._hold)
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return delta
