"""Hypothesis strategies for request bodies, built from the dialects' wire types (adapters/api/*/wire.py).

Each attrs class becomes a JSON object with its required fields and any subset of its optional ones; a union
of block classes becomes objects tagged with one of the wire module's `*_TAGS` names. Now and then a value is
replaced by arbitrary JSON of another shape, so the codecs see both well-formed and broken requests.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any

import attrs
from hypothesis import strategies as st

MODEL = "local-model"
ROLES = ["user", "assistant", "system", "developer", "tool", "function", "model", "wizard", ""]
TYPES = ["function", "custom", "text", "tool", "auto", "any", "none", "enabled", "disabled", "web_search", ""]
EFFORTS = ["none", "minimal", "low", "medium", "high", "xhigh"]

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
junk = st.recursive(
    json_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)

_text = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["hi", "<tool_call>", "</think>", "<think>\n", '{"name": "shell"}', "\x00", "\ud7ff"]),
)

schema = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null"])}),
    lambda inner: st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(st.text(max_size=6), inner, max_size=3)},
            optional={"required": st.lists(st.text(max_size=6), max_size=2)},
        ),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner}),
    ),
    max_leaves=6,
)


def mostly(good: st.SearchStrategy[Any], odd: st.SearchStrategy[Any], one_in: int = 10) -> st.SearchStrategy[Any]:
    """`good` values, and about one time in `one_in` an `odd` one."""
    pick = one_in // 2  # a middle value: hypothesis favours the ends of a range
    return st.integers(0, one_in - 1).flatmap(lambda i: odd if i == pick else good)


# Values that mean something to the server, by field name (the type alone would rarely hit them).
_BY_NAME: dict[str, st.SearchStrategy[Any]] = {
    "model": mostly(st.just(MODEL), st.text(max_size=10)),
    "role": mostly(st.sampled_from(ROLES[:2]), st.sampled_from(ROLES), one_in=5),
    "type": st.sampled_from(TYPES),
    "effort": st.sampled_from(EFFORTS),
    "reasoning_effort": st.sampled_from(EFFORTS),
    "max_tokens": mostly(st.integers(1, 80), st.integers(min_value=-(2**64), max_value=2**64)),
    "max_output_tokens": mostly(st.integers(1, 80), st.integers(-2, 2)),
    "max_completion_tokens": mostly(st.integers(1, 80), st.integers(-2, 2)),
    "budget_tokens": st.integers(min_value=-10, max_value=5000),
    "temperature": mostly(st.floats(0, 2), st.floats()),
    "top_p": mostly(st.floats(0.01, 1), st.floats()),
    "top_k": mostly(st.integers(0, 100), st.integers(-3, -1)),
    "seed": st.integers(min_value=-(2**70), max_value=2**70),
    "n": mostly(st.just(1), st.integers(-1, 3)),
    "frequency_penalty": mostly(st.just(0), st.floats(-2, 2)),
    "presence_penalty": mostly(st.just(0), st.floats(-2, 2)),
    "logprobs": mostly(st.just(False), st.booleans()),
    "top_logprobs": mostly(st.none(), st.integers(0, 5)),
    "logit_bias": mostly(st.none(), st.dictionaries(st.text(max_size=3), st.floats(-5, 5), max_size=2)),
    "parameters": schema,
    "input_schema": schema,
    "tool_choice": st.one_of(
        st.sampled_from(["auto", "none", "required", "any"]),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["function", "auto", "any", "tool", "none"])},
            optional={
                "name": st.sampled_from(["shell", "nope"]),
                "function": st.fixed_dictionaries({"name": st.sampled_from(["shell"])}),
            },
        ),
    ),
    "arguments": st.one_of(st.just('{"command": "ls"}'), st.just("{}"), st.just(""), st.text(max_size=12)),
    "name": mostly(st.just("shell"), st.text(max_size=10), one_in=4),
    "stop": st.one_of(st.none(), st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3)),
    "stop_sequences": st.lists(st.text(max_size=4), max_size=3),
    "previous_response_id": mostly(st.none(), st.text(max_size=8)),
    "signature": st.one_of(st.none(), st.text(max_size=12)),
}


def _tag_maps(module: types.ModuleType) -> list[Mapping[str, type]]:
    return [v for k, v in vars(module).items() if k.endswith("_TAGS") and isinstance(v, dict)]


def _members(tp: Any) -> tuple[Any, ...]:
    return typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else ()


class WireStrategies:
    """Strategies for one dialect's wire module."""

    def __init__(self, module: types.ModuleType) -> None:
        self._module = module
        self._tags = _tag_maps(module)
        self._cache: dict[type, st.SearchStrategy[dict[str, Any]]] = {}

    def body(self, cls: type, **fixed: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        """A request body for `cls`, or now and then something else entirely."""
        return mostly(self.of_class(cls, **fixed), junk, one_in=20)

    def of_class(self, cls: type, **fixed: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
        if cls in self._cache and not fixed:
            return self._cache[cls]
        hints = typing.get_type_hints(cls, vars(self._module))
        required: dict[str, st.SearchStrategy[Any]] = {}
        optional: dict[str, st.SearchStrategy[Any]] = {}
        for f in attrs.fields(cls):
            value = fixed[f.name] if f.name in fixed else self._field(f.name, hints[f.name])
            (required if f.default is attrs.NOTHING else optional)[f.name] = value
        strategy = st.fixed_dictionaries(required, optional=optional)
        if not fixed:
            self._cache[cls] = strategy
        return strategy

    def _field(self, name: str, tp: Any) -> st.SearchStrategy[Any]:
        typed = _BY_NAME[name] if name in _BY_NAME else self._typed(tp)
        # Now and then a value is of any shape: the codec must say which field is wrong, never crash.
        return mostly(typed, junk, one_in=60)

    def _typed(self, tp: Any) -> st.SearchStrategy[Any]:
        members = _members(tp)
        if members:
            blocks = [m for m in members if attrs.has(m)]
            if blocks:
                tags = next((t for t in self._tags if set(t.values()) == set(blocks)), None)
                if tags is not None:
                    return self._tagged(tags)
            return st.one_of([self._typed(m) for m in members])
        origin = typing.get_origin(tp)
        if origin is list:
            (item,) = typing.get_args(tp)
            return st.lists(st.deferred(lambda: self._typed(item)), max_size=3)
        if origin is dict:
            return st.dictionaries(st.text(max_size=6), junk, max_size=3)
        if tp is type(None):
            return st.none()
        if attrs.has(tp):
            return st.deferred(lambda: self.of_class(tp))
        simple: dict[Any, st.SearchStrategy[Any]] = {
            str: _text,
            int: st.integers(min_value=-5, max_value=100),
            float: st.floats(min_value=-2, max_value=2),
            bool: st.booleans(),
            Any: junk,
        }
        return simple.get(tp, junk)

    def _tagged(self, tags: Mapping[str, type]) -> st.SearchStrategy[dict[str, Any]]:
        options = [
            st.deferred(lambda name=name, cls=cls: self.of_class(cls).map(lambda d, name=name: {"type": name, **d}))
            for name, cls in tags.items()
        ]
        return st.one_of(options)
