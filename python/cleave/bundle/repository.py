"""A model repository on disk (docs/repository.md): `REPO/MODEL/VERSION/` bundles, an optional
`REPO/MODEL/model.toml` with the model's version policy, and the content key of every table
(what lets versions and models share a table's memory)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from cleave.bundle import manifest as manifest_io
from cleave.bundle import tables as table_io
from cleave.errors import UsageError
from cleave.settings.config_file import tomllib

MODEL_CONFIG = "model.toml"
# A model name is a URL path segment; Triton's repository allows about the same.
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def is_repository(path: Path) -> bool:
    """A directory without a manifest of its own: a repository (a bundle has one)."""
    return path.is_dir() and not (path / manifest_io.MANIFEST).exists()


def version_bundle(repo: str | Path, model: str, version: str) -> Path:
    """REPO/MODEL/VERSION, checked to be a bundle (ValueError, naming it, if not): what row
    updates for that version are checked against."""
    bundle = Path(repo) / model / version
    if not (bundle / "manifest.json").is_file():
        raise ValueError(f"--repository: {bundle} is not a bundle (no manifest.json)")
    return bundle


def scan(repo: Path) -> dict[str, dict[int, Path]]:
    """Model name -> version -> bundle directory, for every `MODEL/VERSION/` where VERSION is a
    positive integer (other directories and files are ignored, as Triton does). A bundle is
    only found here; it is read when its version is loaded."""
    if not repo.is_dir():
        raise UsageError(f"model repository {repo}: not a directory")
    models: dict[str, dict[int, Path]] = {}
    for model in sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith(".")):
        versions = {
            int(v.name): v
            for v in model.iterdir()
            if v.is_dir() and v.name.isdigit() and int(v.name) > 0
        }
        if versions and _MODEL_NAME.match(model.name):
            models[model.name] = dict(sorted(versions.items()))
    return models


@dataclass(frozen=True)
class VersionPolicy:
    """Triton's `version_policy`: `all`, `latest` N, or `specific` versions."""

    kind: str = "all"
    latest: int = 1
    specific: tuple[int, ...] = ()

    def select(self, present: list[int]) -> list[int]:
        present = sorted(present)
        if self.kind == "latest":
            return present[-self.latest :]
        if self.kind == "specific":
            return [v for v in present if v in self.specific]
        return present

    @classmethod
    def parse(cls, value: object, where: str) -> VersionPolicy:
        """From Triton's JSON form (`{"latest": {"num_versions": 2}}`, `{"all": {}}`,
        `{"specific": {"versions": [1, 3]}}`) or model.toml's (`latest = 2`, `all = true`,
        `specific = [1, 3]`)."""
        expected = (
            'one of {"all": {}}, {"latest": {"num_versions": N}}, '
            '{"specific": {"versions": [V, ...]}}'
        )
        if not isinstance(value, dict) or len(value) != 1:
            raise UsageError(f"{where}: version_policy: expected {expected}, got {value!r}")
        ((kind, arg),) = value.items()
        if kind == "all" and arg in ({}, True):
            return cls("all")
        if kind == "latest":
            n = arg.get("num_versions") if isinstance(arg, dict) else arg
            if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
                return cls("latest", latest=n)
        if kind == "specific":
            versions = arg.get("versions") if isinstance(arg, dict) else arg
            if (
                isinstance(versions, list)
                and versions
                and all(isinstance(v, int) and not isinstance(v, bool) for v in versions)
            ):
                return cls("specific", specific=tuple(versions))
        raise UsageError(f"{where}: version_policy: expected {expected}, got {value!r}")


def model_policy(repo: Path, model: str) -> VersionPolicy:
    """The policy in `REPO/MODEL/model.toml` (`[version_policy]`), else `all`."""
    path = repo / model / MODEL_CONFIG
    if not path.exists():
        return VersionPolicy()
    try:
        with open(path, "rb") as f:
            config = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise UsageError(f"{path}: cannot be read as TOML: {err}") from None
    unknown = sorted(set(config) - {"version_policy"})
    if unknown:
        raise UsageError(f"{path}: unknown keys {unknown}; expected only version_policy")
    if "version_policy" not in config:
        return VersionPolicy()
    return VersionPolicy.parse(config["version_policy"], str(path))


@dataclass(frozen=True)
class TableKey:
    """What makes two tables one: their name (the shards' wire protocol names tables), storage
    type, shape and the SHA-256 of their bytes."""

    name: str
    dtype: str
    rows: int
    dim: int
    sha256: str


def table_keys(bundle: Path, manifest: dict) -> dict[str, TableKey]:
    """Each table's key: its `sha256` as recorded by `cleave partition`, else hashed here (a
    bundle written before the field existed)."""
    keys = {}
    for t in manifest["tables"]:
        digest = t.get("sha256") or table_io.sha256_of(bundle / t["file"])
        keys[t["name"]] = TableKey(t["name"], t["dtype"], int(t["rows"]), int(t["dim"]), digest)
    return keys
