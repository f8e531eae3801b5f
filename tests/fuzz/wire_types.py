"""Wrong-typed variants of a request body, derived from the dialects' wire types (adapters/api/*/wire.py).

`variants(body, cls, module)` walks a well-formed body along its wire class: for every field the body holds
(nested objects, list items and tagged blocks included) and every absent optional top-level field, it yields
the body with that one field set to a JSON value its declared type refuses — a string for an array ("gx" is
not ["g", "x"]), an array or a string for an object, a boolean for a number, a number for a string, null for
a required field. Fields typed `Any` take anything and are skipped.
"""

from __future__ import annotations

import copy
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any

import attrs

Path = tuple[str | int, ...]

# One value of each JSON shape; a type refuses those not in its own shapes.
SHAPES: dict[str, list[Any]] = {
    "string": ["gx"],
    "integer": [3],
    "number": [1.5],
    "boolean": [True],
    "array": [[], ["gx"]],
    "object": [{}],
    "null": [None],
}


def _members(tp: Any) -> tuple[Any, ...]:
    union = isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union
    return typing.get_args(tp) if union else (tp,)


def accepted_shapes(tp: Any) -> set[str] | None:
    """The JSON shapes a field of type `tp` may take (None: any, for `Any`)."""
    shapes: set[str] = set()
    for m in _members(tp):
        if m is Any:
            return None
        origin = typing.get_origin(m)
        if m is type(None):
            shapes.add("null")
        elif m is str:
            shapes.add("string")
        elif m is bool:
            shapes.add("boolean")
        elif m is int:
            shapes.add("integer")
        elif m is float:
            shapes |= {"integer", "number"}
        elif origin is list:
            shapes.add("array")
        elif origin is dict or attrs.has(m):
            shapes.add("object")
    return shapes


def wrong_values(tp: Any) -> list[Any]:
    """JSON values a field of type `tp` must refuse (none for `Any`)."""
    shapes = accepted_shapes(tp)
    if shapes is None:
        return []
    out = [v for shape, values in SHAPES.items() if shape not in shapes for v in values]
    if "array" in shapes:  # an array of the wrong items: a list of strings gets [3]
        items = [typing.get_args(m)[0] for m in _members(tp) if typing.get_origin(m) is list]
        out += [[bad] for bad in wrong_values(items[0])[:1]] if items else []
    return out


class WireTypes:
    """The wire classes of one dialect module, and how its tagged blocks are told apart."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module
        self.tags = [v for k, v in vars(module).items() if k.endswith("_TAGS") and isinstance(v, dict)]

    def hints(self, cls: type) -> dict[str, Any]:
        return typing.get_type_hints(cls, vars(self.module))

    def _class_of(self, tp: Any, value: Any) -> type | None:
        """The attrs class a JSON object `value` of field type `tp` is structured as (None: not an object type)."""
        classes = [m for m in _members(tp) if attrs.has(m)]
        if len(classes) == 1:
            return classes[0]
        if not classes or not isinstance(value, dict):
            return None
        kind = value.get("type", "message" if "role" in value else None)  # Responses' EasyInputMessage
        for tags in self.tags:
            if set(tags.values()) >= set(classes) and kind in tags:
                found: type = tags[kind]
                return found
        return None

    def fields(self, value: Any, tp: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
        """(path, declared type) of every field inside `value`, a JSON value of type `tp`."""
        if isinstance(value, list):
            items = [typing.get_args(m)[0] for m in _members(tp) if typing.get_origin(m) is list]
            for i, item in enumerate(value):
                if items:
                    yield (*path, i), items[0]
                    yield from self.fields(item, items[0], (*path, i))
            return
        cls = self._class_of(tp, value)
        if cls is None or not isinstance(value, dict):
            return
        hints = self.hints(cls)
        for f in attrs.fields(cls):
            if f.name in value:
                yield (*path, f.name), hints[f.name]
                yield from self.fields(value[f.name], hints[f.name], (*path, f.name))
            elif not path:  # an absent optional field of the request itself
                yield (f.name,), hints[f.name]


def with_value(body: Mapping[str, Any], path: Path, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = copy.deepcopy(dict(body))
    node: Any = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def variants(body: Mapping[str, Any], cls: type, wire: WireTypes) -> Iterator[tuple[str, dict[str, Any]]]:
    """(a name, `body` with one field of the wrong JSON type) for every field and every value it refuses."""
    for path, tp in wire.fields(dict(body), cls):
        for bad in wrong_values(tp):
            where = ".".join(str(p) for p in path)
            yield f"{where}={bad!r}", with_value(body, path, bad)
