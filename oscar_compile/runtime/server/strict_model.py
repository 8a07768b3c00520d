"""The base of every request body model: strict types, unknown fields kept, ``null`` as the default.

Its own module so that the protocol models of each concern (protocol.py, tool_protocol.py,
tokenization.py) share it without importing each other.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class StrictModel(BaseModel):
    """No type coercion; unknown fields are kept in ``model_extra`` for ``unknown_fields`` to
    report (or refuse); an explicit ``null`` for a field with a default means that default."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        optional = {name for name, info in cls.model_fields.items() if not info.is_required()}
        return {k: v for k, v in data.items() if v is not None or k not in optional}
