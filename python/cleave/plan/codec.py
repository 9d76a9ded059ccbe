"""Plain data (what YAML gives) <-> the plan's dataclasses, strictly: an unknown key, a missing
key or a wrong type is a `UsageError` that names the file, the field (`shards[2].ranges.t0`),
what was expected and what arrived. Driven by the dataclasses' type hints, so a field added to
a dataclass (a new router key in `RouterConfig`, say) is read and written without editing this
file. A field with a default may be left out; every other field is required."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from cleave.errors import UsageError

_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _field_path(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _got(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def decode(tp: Any, value: Any, where: str, source: str) -> Any:
    """`value` as type `tp`, or a UsageError saying where, what was expected and what came."""

    def fail(expected: str):
        raise UsageError(f"{source}: {where}: expected {expected}, got {_got(value)}")

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):  # `int | None`
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return decode(inner, value, where, source)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where, source)
    if origin is list:
        if not isinstance(value, list):
            fail("a list")
        return [decode(args[0], v, f"{where}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            fail("a mapping")
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise UsageError(f"{source}: {where}: keys must be strings, got {_got(key)}")
            out[key] = decode(args[1], item, _field_path(where, key), source)
        return out
    if origin is tuple:  # fixed-length tuples of scalars, written as a YAML list
        if not isinstance(value, list) or len(value) != len(args):
            fail(f"a list of {len(args)} items")
        items = enumerate(zip(args, value, strict=True))
        return tuple(decode(a, v, f"{where}[{i}]", source) for i, (a, v) in items)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        fail(_KINDS.get(tp, tp.__name__))
    return value


def _fields(cls) -> list[dataclasses.Field]:
    # Fields marked `serialise: False` (the file a plan came from) live only in memory.
    return [f for f in dataclasses.fields(cls) if f.metadata.get("serialise", True)]


def from_dict(cls, value: Any, where: str, source: str):
    """An instance of dataclass `cls` from a mapping; every key known, every required present."""
    if not isinstance(value, dict):
        raise UsageError(f"{source}: {where or 'the file'}: expected a mapping, got {_got(value)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in _fields(cls)}
    for key in value:
        if key not in fields:
            known = ", ".join(fields)
            raise UsageError(
                f"{source}: {_field_path(where, str(key))}: unknown key; known keys here: {known}"
            )
    kwargs = {}
    for name, f in fields.items():
        if name in value:
            kwargs[name] = decode(hints[name], value[name], _field_path(where, name), source)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise UsageError(f"{source}: {_field_path(where, name)}: missing (required)")
    return cls(**kwargs)


def to_dict(obj) -> dict:
    """Plain maps, lists and scalars, in field order (what a Helm template reads)."""
    return {f.name: _plain(getattr(obj, f.name)) for f in _fields(type(obj))}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return to_dict(value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
