"""Tools as typed Python functions: JSON schema from the signature and docstring, and safe calling.

A tool is any (async or sync) function with annotated parameters. Its OpenAI tool schema is derived
from the signature (types -> JSON schema types, defaults -> optional) and its docstring (first
paragraph -> description; ``name: text`` lines under ``Args:`` -> parameter descriptions).
Calling a tool with model-produced arguments never raises: bad JSON, unknown tools and wrong
argument types come back as a :class:`ToolCallError` that the environment turns into a message.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def tool(fn: Callable) -> Callable:
    """Mark a method of a :class:`ToolEnv` as a tool the model may call."""
    fn.__agentrl_tool__ = True  # type: ignore[attr-defined]
    return fn


def _type_schema(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if origin in (list, tuple, set) or annotation in (list, tuple, set):
        args = typing.get_args(annotation)
        return {"type": "array", "items": _type_schema(args[0])} if args else {"type": "array"}
    if origin is dict or annotation is dict:
        return {"type": "object"}
    if origin is typing.Literal:
        values = list(typing.get_args(annotation))
        return {"type": _JSON_TYPES.get(type(values[0]), "string"), "enum": values}
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(options) == 1:
            return _type_schema(options[0])
        return {"anyOf": [_type_schema(a) for a in options]}
    return {}


def _doc_parts(doc: str) -> tuple[str, dict[str, str]]:
    doc = inspect.cleandoc(doc or "")
    description = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    params: dict[str, str] = {}
    in_args = False
    for line in doc.splitlines():
        if line.strip().lower() in ("args:", "arguments:", "parameters:"):
            in_args = True
            continue
        if in_args:
            m = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.+)", line)
            if m:
                params[m.group(1)] = m.group(2).strip()
            elif line.strip() and not line.startswith((" ", "\t")):
                in_args = False
    return description, params


def _unbound(fn: Callable) -> Callable:
    return getattr(fn, "__func__", fn)


@functools.lru_cache(maxsize=4096)
def _signature(fn: Callable) -> tuple[dict[str, inspect.Parameter], dict[str, Any]]:
    """Parameters (without self/cls) and resolved type hints of a plain function, computed once:
    episodes call the same tools millions of times and ``get_type_hints`` evaluates strings."""
    sig = inspect.signature(fn)
    params = {n: p for n, p in sig.parameters.items() if n not in ("self", "cls")}
    return params, typing.get_type_hints(fn)


def tool_schema(fn: Callable) -> dict[str, Any]:
    """The OpenAI ``tools`` entry for ``fn`` (a fresh copy each call; derived once per function)."""
    return _fresh(_tool_schema(_unbound(fn)))


def _fresh(value: Any) -> Any:
    """A deep copy of a JSON-shaped value (every episode's reset copies its tools' schemas:
    ``copy.deepcopy`` took five times as long); anything else in it is deep-copied as before."""
    if type(value) is dict:
        return {k: _fresh(v) for k, v in value.items()}
    if type(value) is list:
        return [_fresh(v) for v in value]
    if value is None or type(value) in (str, int, float, bool):
        return value
    return copy.deepcopy(value)


@functools.lru_cache(maxsize=4096)
def _tool_schema(fn: Callable) -> dict[str, Any]:
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    description, param_docs = _doc_parts(fn.__doc__ or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, param in sig.parameters.items():
        if name in ("self", "cls") or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        prop = _type_schema(hints.get(name, str))
        if name in param_docs:
            prop["description"] = param_docs[name]
        if param.default is inspect.Parameter.empty:
            required.append(name)
        else:
            prop["default"] = param.default
        properties[name] = prop
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


@dataclass
class ToolCallError:
    """Why a model's tool call could not run; becomes the tool message the model sees next."""

    kind: str  # "bad_json" | "unknown_tool" | "bad_arguments" | "tool_raised"
    message: str


def _check_type(value: Any, annotation: Any) -> bool:
    schema = _type_schema(annotation)
    expected = schema.get("type")
    if expected is None:
        return True
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
    }
    return checks[expected](value)


def parse_arguments(fn: Callable, raw: str | dict | None) -> dict[str, Any] | ToolCallError:
    """Decode and type-check model-produced arguments for ``fn``."""
    if isinstance(raw, dict):
        args = raw
    else:
        try:
            args = json.loads(raw or "{}")
        except json.JSONDecodeError as e:
            return ToolCallError("bad_json", f"arguments are not valid JSON: {e}")
        if not isinstance(args, dict):
            return ToolCallError("bad_json", "arguments must be a JSON object")
    params, hints = _signature(_unbound(fn))
    unknown = sorted(set(args) - set(params))
    if unknown:
        return ToolCallError("bad_arguments", f"unknown argument(s) {unknown}; expected {sorted(params)}")
    for name, param in params.items():
        if name not in args:
            if param.default is inspect.Parameter.empty:
                return ToolCallError("bad_arguments", f"missing required argument {name!r}")
            continue
        if name in hints and not _check_type(args[name], hints[name]):
            return ToolCallError("bad_arguments", f"argument {name!r} has the wrong type")
    return args


async def call_tool(fn: Callable, args: dict[str, Any]) -> str:
    """Call a tool; its result becomes text for the model."""
    result = fn(**args)
    if inspect.isawaitable(result):
        result = await result
    return result if isinstance(result, str) else json.dumps(result)


_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ParsedToolCalls:
    """The project's own reading of a text reply in the ``<tool_call>{json}</tool_call>`` format."""

    content: str  # the text outside the tool-call blocks
    tool_calls: list[dict[str, Any]]  # OpenAI format: {"id", "type": "function", "function": {...}}
    errors: list[ToolCallError]  # blocks that are not a valid call (bad JSON, no name)


def parse_tool_calls(text: str, id_prefix: str = "call") -> ParsedToolCalls:
    """Parse hermes-style tool calls out of ``text``; never raises.

    Used where no engine-side tool parser ran (text-only models, the gymnasium wrapper) and to
    explain a reply the engine's parser rejected. An unterminated last block counts as a block.
    """
    calls: list[dict[str, Any]] = []
    errors: list[ToolCallError] = []
    for i, m in enumerate(_TOOL_CALL_RE.finditer(text or "")):
        raw = m.group(1).strip()
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            errors.append(ToolCallError("bad_json", f"tool call {i + 1} is not valid JSON: {e}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append(ToolCallError("bad_json", f'tool call {i + 1} must be a JSON object with a "name"'))
            continue
        args = obj.get("arguments", {})
        calls.append({"id": f"{id_prefix}_{i}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    content = _TOOL_CALL_RE.sub("", text or "").strip()
    return ParsedToolCalls(content=content, tool_calls=calls, errors=errors)
