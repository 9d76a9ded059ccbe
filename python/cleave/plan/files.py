"""Plans on disk: YAML read with `safe_load`, written as plain maps, lists and scalars (no
Python tags, keys in schema order) so a Helm template reads it as-is; writes are atomic."""

from __future__ import annotations

import json
import os
import tempfile
from importlib import metadata
from pathlib import Path

import yaml

from cleave.errors import UsageError
from cleave.plan import codec
from cleave.plan.schema import FORMAT, VERSION, Plan


class _Dumper(yaml.SafeDumper):
    pass


def _list(dumper: yaml.SafeDumper, data: list):
    # A list of numbers (a row range) on one line: `t0: [0, 730]`; the rest in block style.
    flow = all(isinstance(v, (int, float)) for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _list)


def _version() -> str:
    try:
        return metadata.version("cleave")
    except metadata.PackageNotFoundError:
        return "(development tree)"


def read_yaml(path: str | os.PathLike, what: str) -> dict:
    """The YAML file at `path` as a mapping; `what` says what it should be (for errors)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UsageError(f"{path}: {what} not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{path}: {what} cannot be read: {err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise UsageError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a YAML mapping ({what}), got {type(data).__name__}")
    return data


def read_json(path: str | os.PathLike, flag: str, what: str):
    """The JSON file a command-line `flag` names; errors say which flag and what it expected."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"{flag} {path}: not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"{flag} {path}: expected {what}: {err}") from None


def plan_from_dict(data: dict, source: str = "plan") -> Plan:
    data = dict(data)
    fmt, version = data.pop("format", None), data.pop("version", None)
    if fmt != FORMAT:
        raise UsageError(f"{source}: format: expected {FORMAT!r}, got {fmt!r}")
    if version != VERSION or isinstance(version, bool):
        raise UsageError(
            f"{source}: version: expected {VERSION} (this cleave reads plan version {VERSION}), "
            f"got {version!r}"
        )
    return codec.from_dict(Plan, data, "", source)


def plan_to_dict(plan: Plan) -> dict:
    return {"format": FORMAT, "version": VERSION, **codec.to_dict(plan)}


def load_plan(path: str | os.PathLike) -> Plan:
    """The plan in the YAML file at `path`; structure and types checked, not yet the bundle."""
    path = Path(path)
    plan = plan_from_dict(read_yaml(path, "plan"), str(path))
    plan.source = path
    return plan


def dump_plan(plan: Plan, header: str | None = None) -> str:
    lines = [
        f"# Cleave deployment plan (docs/plan.md), written by cleave {_version()}.",
        *(f"# {line}" for line in (header or "").splitlines()),
        "# Hosts and ports are logical: a runner binds the real addresses.",
    ]
    body = yaml.dump(plan_to_dict(plan), Dumper=_Dumper, sort_keys=False, default_flow_style=False)
    return "\n".join(lines) + "\n" + body


def save_plan(plan: Plan, path: str | os.PathLike, header: str | None = None) -> Path:
    """Write `plan` to `path` atomically: a temporary file beside it, renamed into place."""
    path = Path(path)
    write_atomically(path, dump_plan(plan, header))
    return path


def write_atomically(path: Path, text: str) -> None:
    if not path.parent.is_dir():
        raise UsageError(f"{path}: directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide a plan (no secrets) from runners
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
