"""A request body to its protocol model: the 400 that names the field, and the unknown fields.

Unknown fields are accepted and ignored, as vLLM's OpenAI server does (lm-eval spreads a task's
generation kwargs such as ``do_sample`` into the top-level body). Each one is named in a warning
log line the first time it is seen and counted in ``/metrics``
(``oscar_ignored_request_fields_total{field=...}``); with ``strict`` (``--strict-fields``) the
first one is a 400 naming it, as the server answered before.
"""

from __future__ import annotations

import logging
import re
import threading

from pydantic import BaseModel, ValidationError

from oscar_compile.runtime.core.sampling_params import RequestError
from oscar_compile.runtime.server.protocol import unknown_fields

logger = logging.getLogger(__name__)

# a client picks the names: past this many, or longer than this, they count under one label
MAX_IGNORED_FIELD_LABELS = 64
MAX_IGNORED_FIELD_CHARS = 128
OTHER_FIELDS_LABEL = "(other)"
# what pydantic puts in an error's location for the member of a union it tried: "str",
# "list[int]", "TextPart", "function-after[...]"; field names are lower-case and bracket-free
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "bytes", "dict", "list", "none", "any"})


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in _TYPE_NAMES or part[:1].isupper())


def error_param(loc: tuple) -> str | None:
    """The dotted field path of a pydantic error location, union-member tags left out:
    ``("stream_options", "include_usage")`` -> ``"stream_options.include_usage"``,
    ``("prompt", "list[int]", 0)`` -> ``"prompt.0"``."""
    return ".".join(str(part) for part in loc if not _is_union_tag(part)) or None


class IgnoredFields:
    """How many times each unknown field was ignored, for ``/metrics``. Paths are counted with
    list indices as ``*`` (``messages.*.weight``) so the labels stay few."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, paths: list[str]) -> None:
        for path in paths:
            label = re.sub(r"\.\d+(?=\.|$)", ".*", path)
            with self._lock:
                full = label not in self._counts and len(self._counts) >= MAX_IGNORED_FIELD_LABELS
                if full or len(label) > MAX_IGNORED_FIELD_CHARS:
                    label = OTHER_FIELDS_LABEL
                first = label not in self._counts
                self._counts[label] = self._counts.get(label, 0) + 1
            if first:
                logger.warning("ignored an unknown request field %r (further ones are only counted in /metrics: "
                               "oscar_ignored_request_fields_total)", label)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def parse_body(body: bytes, model_cls: type[BaseModel], strict: bool, ignored: IgnoredFields):
    """``body`` validated as ``model_cls``; a RequestError (400) naming the field otherwise."""
    try:
        req = model_cls.model_validate_json(body)
    except ValidationError as err:
        errors = err.errors()
        if errors[0]["type"] == "json_invalid":
            raise RequestError(None, f"request body is not valid JSON: {errors[0]['msg']}") from None
        # the deepest: of a union's members, the one that matched the furthest
        # (content [{"type": "text"}] is missing messages.0.content.0.text, not "not a string")
        first = max(errors, key=lambda e: len((error_param(e["loc"]) or "").split(".")))
        param = error_param(first["loc"])
        where = f"{param}: " if param else "request body: "
        raise RequestError(param, where + first["msg"], code=first["type"]) from None
    unknown = unknown_fields(req)
    if unknown and strict:
        raise RequestError(unknown[0], f"{unknown[0]}: unknown field", code="extra_forbidden")
    ignored.record(unknown)
    return req
