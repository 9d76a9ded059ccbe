"""The `cleave serve` configuration: a TOML file (docs/serving.md, "Config file"), overridden
by command-line flags. The settings themselves (defaults, docs, choices) are declared in
cleave.settings. Every key is checked: an unknown key or a wrong type is an error that
names the file, the key, what was expected and what arrived."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from cleave.errors import UsageError
from cleave.settings import (
    ServeConfig,
    canonical_choices,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


# Keys that older versions took, with what replaced them.
_REPLACED = {
    "restart": "restarts are the default now; set fail_stop = true to stop the deployment "
    "when a child dies instead",
}


def _fill(obj, table: dict, where: str, path: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in table.items():
        name = f"{where}{key}"
        if name in _REPLACED:
            raise UsageError(f"{path}: key {name!r} was removed: {_REPLACED[name]}")
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise UsageError(f"{path}: unknown key {name!r}; known keys here: {known}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise UsageError(f"{path}: [{name}] must be a table, got {value!r}")
            _fill(current, value, f"{name}.", path)
            continue
        kind = int if current is None else type(current)  # grpc_port: unset or a port
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise UsageError(
                f"{path}: {name} must be {_KINDS[kind]}, got {type(value).__name__} {value!r}"
            )
        setattr(obj, key, value)
    canonical_choices(obj, f"{path}: {where}")


def load(path: str | os.PathLike | None) -> ServeConfig:
    """The defaults, overridden by the TOML file at `path` (if any)."""
    config = ServeConfig()
    if path is None:
        return config
    path = Path(path)
    try:
        with path.open("rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"{path}: not valid TOML: {err}") from None
    _fill(config, table, "", str(path))
    return config
