"""Tool-call arguments checked against the tool's JSON schema, so a botched call never reaches a client."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jsonschema  # type: ignore[import-untyped]
from jsonschema import validators  # type: ignore[import-untyped]

from mlx_dspark.domain.chat import ToolSpec


class ArgumentValidator:
    """Validates call arguments per tool; a schema that is itself invalid is not held against the model."""

    def __init__(self, tools: tuple[ToolSpec, ...]) -> None:
        self._tools = {t.name: t for t in tools}
        self._validators: dict[str, Any] = {}

    def knows(self, name: str) -> bool:
        return name in self._tools

    def schema(self, name: str) -> Mapping[str, Any]:
        return self._tools[name].parameters

    def valid(self, name: str, arguments: object) -> bool:
        """True when `name` is an offered tool and `arguments` is an object its schema accepts."""
        if name not in self._tools or not isinstance(arguments, dict):
            return False
        validator = self._validator(name)
        return validator is None or validator.is_valid(arguments)

    def valid_member(self, name: str, key: str, value: object) -> bool:
        """True when `key: value` alone is acceptable (the schema minus its `required` list) for `name`."""
        if name not in self._tools:
            return False
        validator = self._validator(name, partial=True)
        return validator is None or validator.is_valid({key: value})

    def _validator(self, name: str, *, partial: bool = False) -> Any:
        slot = f"{name}\0partial" if partial else name
        if slot not in self._validators:
            schema = dict(self._tools[name].parameters or {})
            if partial:
                schema.pop("required", None)
            cls = validators.validator_for(schema, default=validators.Draft202012Validator)
            try:
                cls.check_schema(schema)
                self._validators[slot] = cls(schema)
            except (jsonschema.SchemaError, TypeError, ValueError):
                self._validators[slot] = None  # an unusable schema: accept any object
        return self._validators[slot]


def coerce_scalar(value: str, schema: Mapping[str, Any] | None) -> Any:
    """Turn a parameter value the model wrote as text into the JSON type its schema asks for.

    Strings stay strings; anything else is parsed as JSON (Python's True/False/None tolerated) and kept
    as text when that fails, so validation then reports the mismatch.
    """
    types = _schema_types(schema)
    if not types or types == {"string"}:
        return value
    text = value.strip()
    for candidate in (text, {"True": "true", "False": "false", "None": "null"}.get(text, text)):
        try:
            parsed = json.loads(candidate)
        except ValueError:
            continue
        if "string" in types and isinstance(parsed, str | int | float) and not isinstance(parsed, bool):
            # a string-or-number parameter keeps the model's text unless it is clearly a number
            return parsed if not isinstance(parsed, str) else value
        return parsed
    return value


def _schema_types(schema: Mapping[str, Any] | None) -> set[str]:
    if not schema:
        return set()
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    out: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, []) or []:
            if isinstance(sub, Mapping):
                out |= _schema_types(sub)
    return out
