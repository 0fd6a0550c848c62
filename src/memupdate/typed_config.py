"""Typed configuration sections: dataclasses whose fields are the only list of a section's keys, built from user
values with the key's full path in every error (:func:`build`), and their JSON schema (:func:`json_schema`).
The sections themselves are :mod:`memupdate.settings`' (and :mod:`memupdate.cluster`'s, which the config check
reads in turn); this module knows none of them.

>>> @dataclasses.dataclass
... class Section:
...     steps: int = setting(1, minimum=1)
>>> build(Section, {"steps": "1e1"}, "x")  # YAML's 1e1 reads as a string: a number in scientific notation is taken
Section(steps=10)
>>> build(Section, {"steps": "two"}, "x")
Traceback (most recent call last):
...
memupdate.typed_config.ConfigError: x.steps: 'two' is not an integer
>>> build(Section, {"steps": 0}, "x")
Traceback (most recent call last):
...
memupdate.typed_config.ConfigError: x.steps: 0 is below the minimum 1
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any, Literal, TypeVar

#: A number in scientific notation without a dot, which YAML 1.2 reads as a float and PyYAML as a string.
SCIENTIFIC = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting is missing, misspelt or of the wrong type or value; the message names its full path."""


def setting(default: Any = dataclasses.MISSING, *, help: str = "", factory: Any = None, **constraints: Any) -> Any:
    """A dataclass field with its help text and JSON-schema constraints (``minimum``, ``maximum``,
    ``exclusiveMinimum``), which :func:`build` enforces."""
    metadata = {"help": help, **constraints}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    # A required setting is keyword-only, so it may follow settings with defaults (and subclasses add them).
    return field(default=default, metadata=metadata, kw_only=default is dataclasses.MISSING)


# ------------------------------------------------------------------------------------------ build


def build(cls: type[T], values: Mapping[str, Any] | None, path: str) -> T:
    """``cls`` from user ``values``, every key checked against ``cls``'s fields and types; ``path`` is where
    the values sit in the config (``experiments.smoke.stage1``) and starts every error message."""
    return _checked(cls, values, path)[0]


def clean(cls: type, values: Mapping[str, Any] | None, path: str) -> dict[str, Any]:
    """The values :func:`build` passes to ``cls``: known keys only, typed (``"1e-6"`` -> ``1e-06``), a null
    where null is not allowed dropped (the default applies). Raises :class:`ConfigError`, naming the key."""
    return _checked(cls, values, path)[1]


def _checked(cls: type[T], values: Mapping[str, Any] | None, path: str) -> tuple[T, dict[str, Any]]:
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        raise ConfigError(f"{path}: expected a mapping of settings, got {show_value(values)}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    hints = _hints(cls)
    errors, out = [], {}
    for key, value in values.items():
        if key not in known:
            moved = getattr(cls, "MOVED", {}).get(key)
            errors.append(f"{path}.{key}: {moved}" if moved else unknown_key(f"{path}.{key}", str(key), known))
            continue
        if value is None and not _admits_none(hints[key]):
            continue
        try:
            out[key] = _convert(value, hints[key], known[key].metadata, f"{path}.{key}")
        except ConfigError as err:
            errors.append(str(err))
    errors += [f"{path}.{name}: required ({_help(known[name])})" for name in _required(cls) if name not in out]
    if errors:
        raise ConfigError("\n".join(errors))
    try:
        return cls(**out), out
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{path}: {err}") from err


def _required(cls: type) -> list[str]:
    """Fields without a default: the settings a user must give."""
    return [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _help(f: dataclasses.Field) -> str:
    return f.metadata.get("help") or "no default"


def unknown_key(path: str, key: str, known: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(known), n=2)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return f"{path}: unknown setting{hint} (allowed: {', '.join(known)})"


def show_value(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _admits_none(hint: Any) -> bool:
    return hint is Any or type(None) in typing.get_args(hint)


def _convert(value: Any, hint: Any, meta: Mapping[str, Any], path: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _convert(value, option, meta, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {show_value(value)} matches none of {options}")
    if origin is Literal:
        # By type too: true == 1 and 2.0 == 2 in Python, not in a config.
        if not any(type(value) is type(arg) and value == arg for arg in args):
            raise ConfigError(f"{path}: {show_value(value)} is not one of {', '.join(map(str, args))}")
        return value
    if origin in (list, Sequence, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {show_value(value)}")
        item = args[0] if args else Any
        return [_convert(v, item, meta, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {show_value(value)}")
        if "schema" in meta:
            return clean(meta["schema"], value, path)
        item = args[1] if len(args) == 2 else Any
        return {str(k): _convert(v, item, {}, f"{path}.{k}") for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: {show_value(value)} is not true or false")
        return value
    if hint is int:
        value = as_number(value)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{path}: {show_value(value)} is not an integer")
        return _bounded(value, meta, path)
    if hint is float:
        value = as_number(value)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(f"{path}: {show_value(value)} is not a number")
        # YAML's .nan and .inf: every comparison with a bound would let them through.
        if not math.isfinite(value):
            raise ConfigError(f"{path}: {value} is not a finite number")
        return _bounded(float(value), meta, path)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: {show_value(value)} is not a string")
        if "pattern" in meta and not re.fullmatch(meta["pattern"], value):
            raise ConfigError(f"{path}: {show_value(value)} does not match {meta['pattern']}")
        return value
    raise TypeError(f"{path}: settings of type {hint} are not supported")


def as_number(value: Any) -> Any:
    if isinstance(value, str) and SCIENTIFIC.match(value.strip()):
        return float(value)
    return value


def _bounded(value: float, meta: Mapping[str, Any], path: str) -> Any:
    if "minimum" in meta and value < meta["minimum"]:
        raise ConfigError(f"{path}: {value} is below the minimum {meta['minimum']}")
    if "exclusiveMinimum" in meta and value <= meta["exclusiveMinimum"]:
        raise ConfigError(f"{path}: {value} must be greater than {meta['exclusiveMinimum']}")
    if "maximum" in meta and value > meta["maximum"]:
        raise ConfigError(f"{path}: {value} is above the maximum {meta['maximum']}")
    return value


# ------------------------------------------------------------------------------------------ schema


def json_schema(cls: type) -> dict[str, Any]:
    """The JSON schema of a settings class, generated from its fields (for documentation and editors)."""
    props = {}
    for f in dataclasses.fields(cls):
        prop = _type_schema(_hints(cls)[f.name])
        if "schema" in f.metadata:
            prop = json_schema(f.metadata["schema"])
        prop.update({k: v for k, v in f.metadata.items() if k in _SCHEMA_KEYWORDS})
        if f.metadata.get("help"):
            prop["description"] = f.metadata["help"]
        if f.default is not dataclasses.MISSING:
            prop["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            prop["default"] = f.default_factory()
        props[f.name] = prop
    required = _required(cls)
    schema = {"type": "object", "description": (cls.__doc__ or "").strip(), "additionalProperties": False}
    return {**schema, "properties": props, **({"required": required} if required else {})}


_SCHEMA_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "pattern")


def _type_schema(hint: Any) -> dict[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    simple = {int: "integer", float: "number", bool: "boolean", str: "string"}
    if hint in simple:
        return {"type": simple[hint]}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_type_schema(a) if a is not type(None) else {"type": "null"} for a in args]}
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (list, Sequence, tuple):
        return {"type": "array", "items": _type_schema(args[0]) if args else {}}
    if origin in (dict, Mapping):
        return {"type": "object", "additionalProperties": _type_schema(args[1]) if len(args) == 2 else {}}
    return {}
