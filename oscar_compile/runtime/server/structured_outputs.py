"""The request fields that constrain the output, mapped onto ``StructuredOutputParams``.

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  (any JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}}`` (the schema; ``strict`` is accepted either way: the schema is always enforced).
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, object or text), ``regex``,
  ``choice`` (a list of strings), ``grammar`` (xgrammar's EBNF), ``json_object`` (true). vLLM's
  tuning fields (``disable_any_whitespace``...) are unknown fields here: the server's JSON is
  always compact (see the backend).

Both routes take both fields, as vLLM's do; a request may not send both. Errors name the field
(``response_format.json_schema.schema``, ``structured_outputs.regex``); a schema or regex that does
not compile is reported when the server compiles it, before the request is admitted.
"""

from __future__ import annotations

from typing import Any

from oscar_compile.runtime.core.sampling_params import RequestError, StructuredOutputParams


def response_format_params(response_format: dict[str, Any]) -> StructuredOutputParams | None:
    """OpenAI's ``response_format`` (None for ``text``)."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputParams(json_object=True, param="response_format")
    if kind != "json_schema":
        raise RequestError(
            "response_format.type", f"response_format.type must be text, json_object or json_schema, got {kind!r}"
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError(
            "response_format.json_schema", "response_format.json_schema must be an object with name and schema"
        )
    where = "response_format.json_schema"
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise RequestError(f"{where}.name", f"{where}.name must be a non-empty string")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise RequestError(f"{where}.schema", f"{where}.schema must be a JSON schema object, got {schema!r}")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise RequestError(f"{where}.strict", f"{where}.strict must be a boolean")
    return StructuredOutputParams(json=schema, param=where, value_param=f"{where}.schema")


def structured_output_params(
    structured_outputs, response_format: dict[str, Any] | None
) -> StructuredOutputParams | None:
    """The request's constraint, from whichever of the two fields it sent (``structured_outputs``:
    protocol.StructuredOutputsRequest)."""
    from_format = response_format_params(response_format) if response_format is not None else None
    if structured_outputs is None:
        return from_format
    if from_format is not None:
        raise RequestError("structured_outputs", "send either response_format or structured_outputs, not both")
    so = structured_outputs
    return StructuredOutputParams(
        json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=bool(so.json_object)
    )
