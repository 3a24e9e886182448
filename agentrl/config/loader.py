"""The config machinery: typed trees of dataclasses built from TOML/YAML and ``--a.b=value`` overrides.

A command's tree (``ServeConfig``, ``LearnConfig``, ``RunConfig``) is made of the components' own
config dataclasses: the buffer's ``BufferConfig``, the sandbox's ``SandboxConfig``, and so on.
This module only knows dataclasses and type hints:

- unknown keys, wrong types and values outside a ``Literal`` are :class:`ConfigError`\\ s naming the
  full key and the choices; a ``ValueError`` from a dataclass's ``__post_init__`` becomes one too;
- a union of dataclasses that each declare ``kind: Literal["name"]`` is a tagged union: a table with
  ``kind`` picks that variant, a bare string is ``{kind = string}``, and a table without ``kind``
  keeps the default's variant when its keys fit it, else takes the one variant whose fields hold
  every key given (so ``--scaffold.command=...`` alone selects the command scaffold);
- a field whose metadata names ``derived`` is filled in by the builder from another setting and may
  not be set (the error says where its value comes from); one whose metadata names a ``key`` is
  spelled so in files and overrides (``import``, a Python keyword, for the field ``imports``);
- a bare string where a list of strings is expected is a list of one;
- every field's documentation is the ``# comment`` on its line or the string right below it, read
  from the source when ``agentrl config show`` prints the tree (:func:`to_toml`).

Nothing heavy is imported: ``agentrl --help`` stays fast.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import math
import re
import textwrap
import tokenize
import tomllib
import types
import typing
from io import StringIO
from pathlib import Path
from typing import Any, Literal

from agentrl.credentials import SecretError, check_override
from agentrl.errors import ConfigError

__all__ = ["ConfigError", "build", "field_docs", "load", "merge", "parse", "resolve", "to_dict", "to_toml",
           "union_kinds"]


# -- tagged unions ---------------------------------------------------------------------------------

def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def union_kinds(tp: Any) -> dict[str, type] | None:
    """``{kind: variant class}`` when ``tp`` is a union of dataclasses tagged by ``kind``; else None."""
    if not _is_union(tp):
        return None
    out: dict[str, type] = {}
    for option in typing.get_args(tp):
        if not dataclasses.is_dataclass(option):
            return None
        hint = typing.get_type_hints(option).get("kind")
        if hint is None or typing.get_origin(hint) is not Literal or len(typing.get_args(hint)) != 1:
            return None
        out[typing.get_args(hint)[0]] = option
    return out


def _pick_variant(value: Any, kinds: dict[str, type], key: str, default: Any) -> tuple[type, dict[str, Any]]:
    if isinstance(value, str):
        value = {"kind": value}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value), to_dict(value)
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected one of {sorted(kinds)} or a table with kind = ..., got {value!r}")
    if "kind" in value:
        kind = value["kind"]
        if kind not in kinds:
            raise ConfigError(f"{key}.kind: {kind!r} is not one of {sorted(kinds)}")
        return kinds[kind], value
    fits = [cls for cls in kinds.values() if set(value) <= {f.name for f in dataclasses.fields(cls)}]
    if default is not None and type(default) in fits:
        return type(default), value
    if len(fits) == 1:
        return fits[0], value
    given = ", ".join(f"{key}.{k}" for k in sorted(value))
    if not fits:
        owners = {
            k: [n for n, c in kinds.items() if k in {f.name for f in dataclasses.fields(c)}] for k in value
        }
        detail = "; ".join(f"{key}.{k} belongs to kind {o or 'none'}" for k, o in owners.items())
        raise ConfigError(f"{key}: {given} do not go together ({detail}); set one kind's settings, not both")
    raise ConfigError(f"{key}: say which kind ({key}.kind = one of {sorted(kinds)}) for {given}")


# -- building ----------------------------------------------------------------------------------------

def _coerce(value: Any, tp: Any, key: str, default: Any = None) -> Any:
    origin = typing.get_origin(tp)
    kinds = union_kinds(tp)
    if kinds is not None:
        cls, data = _pick_variant(value, kinds, key, default)
        return build(cls, data, prefix=key + ".")
    if dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(value) and isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table of settings, got {value!r}")
        return build(tp, value, prefix=key + ".")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if _is_union(tp):
        errors = []
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError("; ".join(errors))
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{key}: expected nothing, got {value!r}")
        return None
    if origin is list and isinstance(value, str) and typing.get_args(tp) in ((str,), ()):
        value = [value]  # one string for a list of strings
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} values, got {value!r}")
            return tuple(
                _coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True))
            )
        item = args[0] if args else Any
        out = [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {value!r}")
        item = typing.get_args(tp)[1] if typing.get_args(tp) else Any
        return {k: _coerce(v, item, f"{key}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def parse(tp: Any, value: Any, key: str = "value") -> Any:
    """``value`` read as type ``tp`` (a dataclass, a tagged union, a Literal, ...), named ``key`` in
    errors."""
    return _coerce(value, tp, key)


def build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """``cls`` built from ``data`` (nested dicts), every key and type checked."""
    hints = typing.get_type_hints(cls)
    fields = {setting_key(f): f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown setting {prefix}{unknown[0]}; known settings here: "
                          f"{', '.join(prefix + n for n in sorted(fields))}")
    kwargs = {}
    for k, v in data.items():
        derived = fields[k].metadata.get("derived")
        if derived:
            raise ConfigError(f"{prefix}{k} is not set directly: it comes from {derived}")
        kwargs[fields[k].name] = _coerce(v, hints[fields[k].name], prefix + k, _default(fields[k]))
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {e}") from None


def setting_key(f: dataclasses.Field) -> str:
    """How a field is spelled in config files and overrides (its name, unless its metadata says ``key``)."""
    return f.metadata.get("key", f.name)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        try:
            return json.loads(text)
        except ValueError:
            return text  # a bare string


def read_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {p} does not exist")
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(p.read_text()) or {}
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, ValueError) as e:
        raise ConfigError(f"config file {p} is not valid {p.suffix.lstrip('.') or 'TOML'}: {e}") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``--a.b=value`` settings laid on ``data`` (values parsed as TOML, then JSON, else a string)."""
    for item in overrides:
        item = item[2:] if item.startswith("--") else item
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like --section.key=value")
        key, text = item.split("=", 1)
        try:
            check_override(key)
        except SecretError as e:
            raise ConfigError(str(e)) from None
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if isinstance(nxt, str):  # a tagged union given as its kind: now with settings too
                nxt = node[part] = {"kind": nxt}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {key}: {part} is not a section")
            node = nxt
        node[parts[-1]] = _parse_value(text)
    return data


def load(cls: type, path: str | Path | None = None, overrides: list[str] | None = None,
         defaults: dict[str, Any] | None = None) -> Any:
    """Build ``cls`` from ``defaults``, then an optional TOML/YAML file, then ``a.b=value`` overrides
    (each laid on the one before, table by table), and run its ``check()``."""
    data = apply_overrides(read_file(path) if path else {}, list(overrides or []))
    if defaults:
        data = merge(json.loads(json.dumps(defaults)), data)
    cfg = build(cls, data)
    check = getattr(cfg, "check", None)
    if callable(check):
        check()
    return cfg


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base``: tables merge key by key, anything else replaces (a tagged union's
    table without ``kind`` keeps the base's kind only if it names none of its own)."""
    for k, v in over.items():
        b = base.get(k)
        if isinstance(v, dict) and isinstance(b, dict):
            base[k] = merge(b, v)
        elif isinstance(v, dict) and isinstance(b, str) and "kind" not in v:
            base[k] = merge({"kind": b}, v)
        else:
            base[k] = v
    return base


# -- reading a tree ----------------------------------------------------------------------------------

def _plain(v: Any) -> Any:
    """``v`` as plain data: dataclasses (also as a table's values) as dicts spelled as in files."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {setting_key(f): _plain(getattr(v, f.name)) for f in dataclasses.fields(v)
                if not f.metadata.get("derived")}
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return json.loads(json.dumps(v, default=list))  # tuples as lists, as TOML gives them back


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config's settings as nested dicts, spelled as in files (``build`` reads it back to an equal
    config; fields the builder fills in are left out)."""
    return _plain(cfg)


def resolve(cls: type, dotted: str) -> bool:
    """Whether ``dotted`` (e.g. ``buffer.lease_s``) names a setting of ``cls``'s tree (any variant of a
    union)."""
    parts = dotted.split(".")

    def walk(tp: Any, rest: list[str]) -> bool:
        if not rest:
            return True
        kinds = union_kinds(tp)
        if kinds is not None:
            return any(walk(c, rest) for c in kinds.values())
        if _is_union(tp):
            return any(walk(t, rest) for t in typing.get_args(tp) if t is not type(None))
        if not dataclasses.is_dataclass(tp):
            return typing.get_origin(tp) is dict or tp is Any  # a free-form table: any key is its own
        hints = typing.get_type_hints(tp)
        names = {setting_key(f): f.name for f in dataclasses.fields(tp)}
        return rest[0] in names and walk(hints[names[rest[0]]], rest[1:])

    return walk(cls, parts)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's documentation: its line's ``# comment``, or the string literal just below it."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        comments = {}
        for tok in tokenize.generate_tokens(StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.string.lstrip("#").strip()
        body = ast.parse(source).body[0]
        if not isinstance(body, ast.ClassDef):
            continue
        stmts = body.body
        for i, node in enumerate(stmts):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            name = node.target.id
            after = stmts[i + 1] if i + 1 < len(stmts) else None
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[name] = " ".join(after.value.value.split())
            elif node.end_lineno in comments:
                docs[name] = comments[node.end_lineno].removeprefix("noqa").strip()
    return docs


def _toml_key(k: str) -> str:
    """A table key as TOML spells it: bare when it can be (letters, digits, _ and -), else quoted."""
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(v)


def _ordered_fields(node: Any) -> list[dataclasses.Field]:
    """A dataclass's fields with its own first, then each base's: a section reads most specific first
    (``kind`` of a tagged union always leads)."""
    own: list[dataclasses.Field] = []
    seen: set[str] = set()
    for klass in type(node).__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        names = klass.__dict__.get("__annotations__", {})
        for f in dataclasses.fields(node):
            if f.name in names and f.name not in seen:
                seen.add(f.name)
                own.append(f)
    return sorted(own, key=lambda f: f.name != "kind")


def to_toml(cfg: Any, docs: bool = False) -> str:
    """The config as TOML (scalars first, then one table per section); with ``docs``, each setting
    is preceded by its documentation as comments. Parses back (``build``) to an equal config.
    Settings whose value is None are left out (TOML has no null; their default is None)."""
    def emit(node: Any, prefix: str) -> list[str]:
        lines, tables = [], []
        notes = field_docs(type(node)) if docs else {}
        for f in _ordered_fields(node):
            v = getattr(node, f.name)
            if dataclasses.is_dataclass(v):
                tables.append((f.name, v))
                continue
            if f.metadata.get("derived") or v is None:
                continue  # filled in by the builder (not a setting), or nothing TOML can say
            if notes.get(f.name):
                lines += textwrap.wrap(notes[f.name], 100, initial_indent="# ", subsequent_indent="# ")
            lines.append(f"{setting_key(f)} = {_toml_value(_plain(v))}")
        out = lines
        for name, v in tables:
            out += ["", f"[{prefix}{name}]"]
            doc = (type(v).__doc__ or "").strip() if docs else ""
            if doc and not doc.startswith(type(v).__name__ + "("):  # not dataclass's generated signature
                out += textwrap.wrap(
                    " ".join(doc.split()), 100, initial_indent="## ", subsequent_indent="## "
                )
            out += emit(v, f"{prefix}{name}.")
        return out

    return "\n".join(emit(cfg, "")).lstrip("\n") + "\n"
