"""Helpers every dialect uses: a strict cattrs converter, path-aware request errors, SSE framing, ids.

Dialects may import this module but never each other.
"""

from __future__ import annotations

import json
import re
import typing
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.cols import list_structure_factory, mapping_structure_factory
from cattrs.gen import make_dict_structure_fn
from cattrs.v import format_exception

from mlx_dspark.domain.chat import ToolChoice, ToolChoiceMode
from mlx_dspark.domain.errors import (
    CapacityExceeded,
    ContextTooLong,
    DomainError,
    InvalidRequest,
    ModelUnavailable,
    Overloaded,
    quoted,
)

T = TypeVar("T")


class WireValueError(ValueError):
    """A value the wire types reject with a message of our own (kept verbatim in the 400)."""


def _strict_str(v: Any, _: Any) -> str:
    if not isinstance(v, str):
        raise WireValueError(f"expected a string, got {_json_type(v)}")
    return v


def _strict_int(v: Any, _: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise WireValueError(f"expected an integer, got {_json_type(v)}")
    return v


def _strict_float(v: Any, _: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise WireValueError(f"expected a number, got {_json_type(v)}")
    return float(v)


def _strict_bool(v: Any, _: Any) -> bool:
    if not isinstance(v, bool):
        raise WireValueError(f"expected a boolean, got {_json_type(v)}")
    return v


def _json_type(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number"
    )


def _only(kind: type, what: str, hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """`hook` for values of JSON type `kind` only: cattrs alone would iterate a string as a list of its
    characters, or read a string or an array as an object whose optional fields are all absent."""

    def check(v: Any, t: Any) -> Any:
        if not isinstance(v, kind):
            raise WireValueError(f"expected {what}, got {_json_type(v)}")
        return hook(v, t)

    return check


def strict_converter() -> cattrs.Converter:
    """A converter that ignores unknown keys but never coerces types ("3" is not an int, "gx" is not a list)."""
    conv = cattrs.Converter(forbid_extra_keys=False)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(Any, lambda v, _: v)
    conv.register_structure_hook_factory(
        lambda t: typing.get_origin(t) is list, lambda t: _only(list, "an array", list_structure_factory(t, conv))
    )
    conv.register_structure_hook_factory(
        lambda t: typing.get_origin(t) is dict, lambda t: _only(dict, "an object", mapping_structure_factory(t, conv))
    )
    conv.register_structure_hook_factory(attrs.has, lambda t: _only(dict, "an object", make_dict_structure_fn(t, conv)))
    return conv


def register_tagged(conv: cattrs.Converter, union: Any, tags: Mapping[str, type], what: str) -> None:
    """Structure `union` by its "type" key; an unknown type is a clear error naming it."""

    def hook(v: Any, _: Any) -> Any:
        if not isinstance(v, dict):
            raise WireValueError(f"expected {what} object, got {_json_type(v)}")
        tag = v.get("type")
        cls = tags.get(tag) if isinstance(tag, str) else None
        if cls is None:
            known = ", ".join(sorted(tags))
            raise WireValueError(f"unknown {what} type {quoted(tag)} (supported: {known})")
        return conv.structure(v, cls)

    conv.register_structure_hook(union, hook)


def register_text_or_list(conv: cattrs.Converter, union: Any, item: Any) -> None:
    """Structure `str | list[item]` (content that is either a string or a list of blocks)."""

    nullable = type(None) in typing.get_args(union)

    def hook(v: Any, _: Any) -> Any:
        if v is None and nullable:
            return None
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            return conv.structure(v, list[item])
        raise WireValueError(f"expected a string or an array, got {_json_type(v)}")

    conv.register_structure_hook(union, hook)


def _format(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, WireValueError):
        return str(exc)
    return format_exception(exc, type_)


MAX_PROBLEMS = 10  # a body with a thousand broken items gets the first few, not a megabyte of errors


def structure(conv: cattrs.Converter, data: Any, cls: type[T]) -> T:
    """`data` as `cls`.

    Raises:
        InvalidRequest: with every problem and its JSON path (e.g. `expected a string @ $.messages[0].role`).
    """
    if not isinstance(data, dict):
        raise InvalidRequest(message=f"the request body must be a JSON object, got {_json_type(data)}")
    try:
        return conv.structure(data, cls)
    except cattrs.BaseValidationError as exc:
        problems = cattrs.transform_error(exc, path="$", format_exception=_format)
        first = problems[0] if problems else str(exc)
        param = first.rsplit(" @ $.", 1)[1] if " @ $." in first else None
        shown = problems[:MAX_PROBLEMS] + (
            [f"and {len(problems) - MAX_PROBLEMS} more"] if len(problems) > MAX_PROBLEMS else []
        )
        raise InvalidRequest(message="invalid request: " + "; ".join(shown), param=param) from exc
    except (WireValueError, TypeError, ValueError) as exc:
        raise InvalidRequest(message=f"invalid request: {exc}") from exc


def check_range(value: float | None, name: str, low: float, high: float) -> None:
    """Refuse a sampling value outside the dialect's documented range (None: not sent).

    Raises:
        InvalidRequest: below `low`, above `high`, or not a number (NaN), with `param` = `name`.
    """
    if value is not None and not low <= value <= high:
        raise InvalidRequest(message=f"{name} must be between {low:g} and {high:g}, got {value:g}", param=name)


MAX_JSON_DEPTH = 64  # far above any real request; keeps recursive code downstream (templates, schemas) safe


def parse_json_body(raw: bytes) -> Any:
    """The request body as JSON.

    Raises:
        InvalidRequest: empty or malformed JSON (with the position of the error), or nested too deeply.
    """
    if not raw.strip():
        raise InvalidRequest(message="the request body is empty; expected a JSON object")
    too_deep = InvalidRequest(message=f"the request body is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        value = json.loads(raw)
    except RecursionError as exc:
        raise too_deep from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(message=f"the request body is not valid JSON: {exc}") from exc
    if _depth(value) > MAX_JSON_DEPTH:
        raise too_deep
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(value):
        # Valid JSON, but no tokenizer can encode it (it is not Unicode text).
        raise InvalidRequest(message="the request body contains an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)")
    return value


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _depth(value: Any) -> int:
    """How deeply arrays and objects nest in `value` (iterative: any depth is safe to measure)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children if isinstance(child, dict | list))
    return deepest


def sse(data: Mapping[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event: optional `event:` line, one `data:` line, blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def loads_arguments(text: str) -> dict[str, Any]:
    """Tool-call arguments sent back by a client as a JSON string (empty = no arguments).

    Raises:
        InvalidRequest: not a JSON object.
    """
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(message=f"tool call arguments are not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidRequest(message="tool call arguments must be a JSON object")
    return value


Factory = Callable[[], str]


_OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


def openai_envelope(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body (Chat Completions and Responses share it): `{"error": {message, type, param, code}}`."""
    error_type = _OPENAI_ERROR_TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


OpenAIError = tuple[int, str, str | None, str | None]


def openai_classify(
    exc: BaseException,
    *,
    context: Callable[[ContextTooLong], tuple[str, str]],
    overloaded_code: str,
    server_code: str | None,
) -> OpenAIError:
    """(status, message, param, code) of an error in OpenAI's vocabulary; the two OpenAI dialects differ only
    in the context-overflow wording and param (`context(exc)` gives both) and in two codes."""
    if isinstance(exc, ContextTooLong):
        message, param = context(exc)
        return 400, message, param, "context_length_exceeded"
    if isinstance(exc, InvalidRequest):
        return 400, exc.message, exc.param, None
    if isinstance(exc, ModelUnavailable):
        return 404, exc.message, "model", "model_not_found"
    if isinstance(exc, Overloaded):
        return 429, exc.message, None, "rate_limit_exceeded"
    if isinstance(exc, CapacityExceeded):
        return 503, exc.message, None, overloaded_code
    if isinstance(exc, DomainError):
        return 500, exc.message, None, server_code
    return 500, "internal server error", None, server_code


def part_texts(parts: list[Any], *, text: Any, refusal: Any, refused: str, where: str) -> list[str]:
    """The text of OpenAI content parts: `text` and `refusal` parts read as text, any other part is refused.

    Raises:
        InvalidRequest: a part of another type ("{refused} input are not supported", param `where.j`).
    """
    out = []
    for j, p in enumerate(parts):
        if isinstance(p, text):
            out.append(p.text)
        elif isinstance(p, refusal):
            out.append(p.refusal)
        else:
            raise InvalidRequest(
                message=f"{refused} input are not supported by this text-only model ({where}.{j})", param=f"{where}.{j}"
            )
    return out


def allowed_tool_choice(mode: Any, tools: Any, name_of: Callable[[Any], Any]) -> ToolChoice:
    """OpenAI's `allowed_tools` choice: `mode` auto|required over the tools whose names `name_of` reads.

    Raises:
        InvalidRequest: a mode or a tool list of the wrong shape.
    """
    if mode not in ("auto", "required"):
        raise InvalidRequest(
            message=f"allowed_tools mode must be 'auto' or 'required', got {quoted(mode)}", param="tool_choice"
        )
    if not isinstance(tools, list):
        raise InvalidRequest(message="allowed_tools needs a list of tools", param="tool_choice")
    names = [name_of(t) for t in tools if isinstance(t, dict)]
    chosen = ToolChoiceMode.REQUIRED if mode == "required" else ToolChoiceMode.AUTO
    return ToolChoice(mode=chosen, allowed=tuple(n for n in names if isinstance(n, str)))


def openai_tool_choice(choice: Any, dict_form: Callable[[dict[str, Any], Any], ToolChoice | None]) -> ToolChoice:
    """OpenAI's `tool_choice`: the string forms ("auto", "none", "required", or absent) here, the dialect's
    object forms from `dict_form(choice, its "type")` (None: not one it knows).

    Raises:
        InvalidRequest: any other value.
    """
    if choice is None or choice == "auto":
        return ToolChoice()
    if choice == "none":
        return ToolChoice(mode=ToolChoiceMode.NONE)
    if choice == "required":
        return ToolChoice(mode=ToolChoiceMode.REQUIRED)
    if isinstance(choice, dict):
        found = dict_form(choice, choice.get("type"))
        if found is not None:
            return found
    raise InvalidRequest(message=f"unsupported tool_choice {quoted(choice)}", param="tool_choice")
