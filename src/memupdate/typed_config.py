"""Typed configuration sections on pydantic: dataclasses whose fields are the only list of a section's keys,
validated by pydantic (types, defaults, bounds, patterns, ``__post_init__`` checks) and built from user values
with the key's full path in every error (:func:`build`). The sections themselves are :mod:`memupdate.settings`'
(and :mod:`memupdate.cluster`'s, which the config check reads in turn); this module knows none of them.

A section (:func:`section`) is a standard dataclass (``dataclasses.fields``, ``asdict`` and ``replace`` work on it)
whose fields are declared with :func:`setting` and the YAML-aware types below, so pydantic reads one definition:

>>> @section
... class Steps:
...     steps: Int = setting(1, help="optimizer steps", ge=1)
>>> build(Steps, {"steps": "1e1"}, "x")  # YAML's 1e1 reads as a string: a number in scientific notation is taken
Steps(steps=10)
>>> build(Steps, {"steps": "two", "step": 3}, "x")
Traceback (most recent call last):
...
memupdate.typed_config.ConfigError: x.steps: 'two' is not an integer
x.step: unknown setting; did you mean steps? (allowed: steps)
>>> build(Steps, {"steps": 0}, "x")
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
from collections.abc import Mapping
from dataclasses import field
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BeforeValidator, ConfigDict, Strict, TypeAdapter, ValidationError, with_config
from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import PydanticCustomError, core_schema

#: A number in scientific notation without a dot, which YAML 1.2 reads as a float and PyYAML as a string.
SCIENTIFIC = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting is missing, misspelt or of the wrong type or value; the message names its full path."""


# ------------------------------------------------------------------------------------------ types


def as_number(value: Any) -> Any:
    """``value`` as a float if it is a string in scientific notation (PyYAML's reading of ``1e-6``), else as is."""
    if isinstance(value, str) and SCIENTIFIC.match(value.strip()):
        return float(value)
    return value


def _integer(value: Any) -> int:
    value = as_number(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise PydanticCustomError("memupdate_int", "{shown} is not an integer", {"shown": show_value(value)})
    return value


def _number(value: Any) -> float:
    value = as_number(value)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise PydanticCustomError("memupdate_float", "{shown} is not a number", {"shown": show_value(value)})
    # YAML's .nan and .inf: every comparison with a bound would let them through.
    if not math.isfinite(value):
        raise PydanticCustomError("memupdate_finite", "{shown} is not a finite number", {"shown": str(value)})
    return float(value)


def _exact(value: Any) -> Any:
    # true == 1 and 2.0 == 2 in Python (and to pydantic's Literal), not in a config.
    if isinstance(value, bool | float):
        raise PydanticCustomError("literal_error", "not one of the allowed values")
    return value


#: An integer setting: also ``2.0`` and ``"1e1"`` (a YAML float, a PyYAML string), never ``true`` or ``"3"``.
Int = Annotated[int, BeforeValidator(_integer)]
#: A finite number: also ``"1e-6"`` (PyYAML's string), never ``true``, ``"0.5"``, ``.nan`` or ``.inf``.
Float = Annotated[float, BeforeValidator(_number)]
#: ``true`` or ``false``, never ``1`` or ``"yes"``.
Bool = Annotated[bool, Strict()]
#: A string, never a number.
Str = Annotated[str, Strict()]
#: Marks a ``Literal`` of integers as taking integers only: ``Annotated[Literal[1, 2], EXACT]``.
EXACT = BeforeValidator(_exact)


class Section:
    """Marks a ``dict[str, Any]`` setting as a nested section: its values are checked as ``cls``'s fields and kept
    as a mapping (``Annotated[dict[str, Any], Section(TrainOn)]``) of the keys given, or of every field with its
    default if ``filled``."""

    def __init__(self, cls: type, *, filled: bool = False) -> None:
        self.cls, self.filled = cls, filled

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        def nested(value: Any, validate: Any) -> dict[str, Any]:
            if not isinstance(value, Mapping):
                raise PydanticCustomError("dict_type", "expected a mapping")
            value = _without_nulls(self.cls, value)
            typed = validate(value)
            keys = [f.name for f in dataclasses.fields(self.cls)] if self.filled else list(value)
            return {key: getattr(typed, key) for key in keys}

        return core_schema.no_info_wrap_validator_function(nested, handler.generate_schema(self.cls))


@typing.dataclass_transform(field_specifiers=(dataclasses.field,))
def section(cls: type[T] | None = None, /, *, frozen: bool = False) -> Any:
    """A settings section: a standard dataclass that pydantic builds refusing any key it does not know."""

    def wrap(cls: type[T]) -> type[T]:
        return with_config(ConfigDict(extra="forbid"))(dataclasses.dataclass(frozen=frozen)(cls))

    return wrap if cls is None else wrap(cls)


def setting(default: Any = dataclasses.MISSING, *, help: str = "", factory: Any = None, **constraints: Any) -> Any:
    """A dataclass field with its help text and pydantic's ``Field`` constraints (``ge``, ``le``, ``gt``,
    ``min_length``, a ``pattern`` the whole string must match) in the metadata pydantic reads; other keys stay for
    the section's own use (``flag``), or mark a named collection whose null entries are removed (``removable``)."""
    metadata = dict(constraints)
    if "pattern" in metadata:
        metadata["pattern"] = f"^(?:{metadata['pattern']})$"
    if help:
        metadata["description"] = help
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
    values = _without_nulls(cls, values)
    try:
        typed = _adapter(cls).validate_python(values)
    except ValidationError as err:
        raise ConfigError("\n".join(_message(cls, path, e) for e in err.errors())) from None
    return typed, {key: getattr(typed, key) for key in values}


@functools.cache
def _adapter(cls: type) -> TypeAdapter:
    return TypeAdapter(cls)


def _without_nulls(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    # A --configfile cannot delete a key of config/config.yaml: a null where null is not valid falls back to the
    # default instead, and a null entry of a named collection (a setting marked `removable`: models, experiments,
    # ...) removes the entry.
    hints = _hints(cls)
    removable = {f.name for f in dataclasses.fields(cls) if f.metadata.get("removable")}
    out = {}
    for key, value in values.items():
        if value is None and key in hints and not _admits_none(hints[key]):
            continue
        if key in removable and isinstance(value, Mapping):
            value = {name: entry for name, entry in value.items() if entry is not None}
        out[key] = value
    return out


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _admits_none(hint: Any) -> bool:
    hint = _bare(hint)
    return hint is Any or type(None) in typing.get_args(hint)


def _bare(hint: Any) -> Any:
    """``hint`` without its ``Annotated`` wrapper."""
    return typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint


def _message(cls: type, path: str, error: Mapping[str, Any]) -> str:
    """One of pydantic's errors in our words: the key's full path, the bad value, what is allowed."""
    loc, kind, value, ctx = error["loc"], error["type"], error["input"], error.get("ctx") or {}
    where = (path + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)).lstrip(".")
    where = where or "(top level)"
    shown = show_value(value)
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        owner = _unwrap(_at(cls, loc[:-1]))
        moved = getattr(owner, "MOVED", {}).get(loc[-1])
        return f"{where}: {moved}" if moved else unknown_key(where, str(loc[-1]), _hints(owner))
    if kind == "missing":
        owner = _unwrap(_at(cls, loc[:-1]))
        help = {f.name: f.metadata.get("description") for f in dataclasses.fields(owner)}.get(loc[-1])
        return f"{where}: required ({help or 'no default'})"
    if kind == "literal_error":
        allowed = typing.get_args(_literal_at(cls, loc))
        return f"{where}: {shown} is not one of {', '.join(map(str, allowed))}"
    if kind == "value_error":
        return f"{where}: {ctx['error']}"
    texts = {
        "greater_than_equal": lambda: f"{value} is below the minimum {ctx['ge']}",
        "greater_than": lambda: f"{value} must be greater than {ctx['gt']}",
        "less_than_equal": lambda: f"{value} is above the maximum {ctx['le']}",
        "string_pattern_mismatch": lambda: f"{shown} does not match {ctx['pattern'][4:-2]}",
        "string_type": lambda: f"{shown} is not a string",
        "bool_type": lambda: f"{shown} is not true or false",
        "list_type": lambda: f"expected a list, got {shown}",
        "too_short": lambda: (
            f"{shown} needs at least {ctx['min_length']} {'entry' if ctx['min_length'] == 1 else 'entries'}"
        ),
        "dict_type": lambda: f"expected a mapping, got {shown}",
    }
    if kind in texts:
        return f"{where}: {texts[kind]()}"
    return f"{where}: {error['msg']}" if kind.startswith("memupdate_") else f"{where}: {shown}: {error['msg']}"


def _at(cls: type, loc: tuple[Any, ...]) -> Any:
    """The type of the setting at ``loc`` (pydantic's error location) within ``cls``."""
    hint: Any = cls
    for part in loc:
        hint = _unwrap(hint)
        if dataclasses.is_dataclass(hint):
            hint = _hints(hint)[part]
        else:
            args = typing.get_args(hint)
            hint = args[-1] if args else Any
    return hint


def _unwrap(hint: Any) -> Any:
    """A nested section's class, or the type inside an optional or annotated one."""
    if typing.get_origin(hint) is Annotated:
        nested = [m.cls for m in hint.__metadata__ if isinstance(m, Section)]
        return nested[0] if nested else _unwrap(typing.get_args(hint)[0])
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return _unwrap(options[0]) if len(options) == 1 else hint
    return hint


def _literal_at(cls: type, loc: tuple[Any, ...]) -> Any:
    hint = _unwrap(_at(cls, loc))
    return hint if typing.get_origin(hint) is Literal else Literal[()]


def unknown_key(path: str, key: str, known: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(known), n=2)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return f"{path}: unknown setting{hint} (allowed: {', '.join(known)})"


def show_value(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _WithFactoryDefaults(GenerateJsonSchema):
    # A list or mapping setting's default comes from a factory, which pydantic leaves out of the schema by default.
    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        factory = schema.get("default_factory")
        return (
            factory() if factory and not schema.get("default_factory_takes_data") else super().get_default_value(schema)
        )


def json_schema(cls: type) -> dict[str, Any]:
    """The JSON schema of a settings class, generated by pydantic from its fields (for documentation and editors)."""
    return _adapter(cls).json_schema(schema_generator=_WithFactoryDefaults)
