"""manifest.json: reading, checking and writing (docs/bundle.md). The one reader of a bundle's
metadata; it needs no torch, so launchers, planners and benchmarks use it directly."""

from __future__ import annotations

import json
from pathlib import Path

from cleave.errors import BundleError
from cleave.settings.choices import DENSE_DTYPES

FORMAT = "cleave-bundle"
VERSION = 1
MANIFEST = "manifest.json"

POOLINGS = ("sum", "mean", "max", "none")
LAYOUTS = ("offsets", "fixed", "gather", "kjt")
TRANSFORMS = ("remainder", "fmod", "cast")
INPUT_ROLES = ("ids", "offsets", "weights", "lengths", "dense", "both", "unused")

_REQUIRED = {
    "inputs": list,
    "outputs": list,
    "output_spec": str,
    "tables": list,
    "features": list,
    "boundary": list,
    "dense": dict,
    "shared_inputs": list,
}


def read(bundle_dir: Path, whole: bool = True) -> dict:
    """The manifest of `bundle_dir`, checked: all of it, or with `whole=False` only its format,
    version and tables (what planning and launching read; a manifest-only bundle passes)."""
    path = Path(bundle_dir) / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise BundleError(f"{path}: not found; is {bundle_dir} a Cleave bundle?") from None
    except OSError as err:
        raise BundleError(f"{path}: cannot be read: {err}") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as err:
        raise BundleError(f"{path}: not valid JSON ({err}); the bundle is corrupted") from None
    (check if whole else check_header)(manifest, path)
    return manifest


def write(bundle_dir: Path, manifest: dict) -> None:
    (bundle_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def check_header(manifest: dict, path: Path) -> None:
    """The format and version, and a list of tables: BundleError naming the file otherwise."""

    def fail(problem: str):
        raise BundleError(f"{path}: {problem}")

    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        fail(f"expected format {FORMAT!r}, found {found!r}")
    version = manifest.get("version")
    if not isinstance(version, int):
        fail(f"expected an integer 'version', found {version!r}")
    if version > VERSION:
        fail(
            f"bundle format version {version} is newer than this Cleave reads "
            f"(version {VERSION}); upgrade Cleave or re-partition the model"
        )
    if not isinstance(manifest.get("tables"), list):
        fail(f"expected 'tables' to be a list, found {manifest.get('tables')!r}")


def check(manifest: dict, path: Path) -> None:
    """Raises BundleError naming the file and the first problem found."""

    def fail(problem: str):
        raise BundleError(f"{path}: {problem}")

    check_header(manifest, path)
    for key, kind in _REQUIRED.items():
        if not isinstance(manifest.get(key), kind):
            fail(f"expected {key!r} to be a {kind.__name__}, found {manifest.get(key)!r}")
    for i in manifest["inputs"]:
        if i.get("role") not in INPUT_ROLES:
            role = i.get("role")
            fail(f"input {i.get('name')!r}: role must be one of {INPUT_ROLES}, found {role!r}")
    inputs = {i["name"] for i in manifest["inputs"]}
    tables = {t["name"] for t in manifest["tables"]}
    boundary = {b["name"] for b in manifest["boundary"]}
    for f in manifest["features"]:
        where = f"feature {f.get('name')!r}"
        if f.get("table") not in tables:
            fail(f"{where} names table {f.get('table')!r}, which the manifest does not list")
        for key in ("ids", "offsets", "weights", "lengths"):
            if f.get(key) is not None and f[key] not in inputs:
                fail(f"{where}: {key} input {f[key]!r} is not among the inputs")
        if f.get("layout") == "kjt":
            keys = {k["name"]: k["keys"] for k in manifest.get("kjts", [])}
            if f.get("key") not in keys.get(f.get("kjt"), []):
                fail(f"{where}: key {f.get('key')!r} of KJT {f.get('kjt')!r} is not in 'kjts'")
        if f.get("pooling") not in POOLINGS:
            fail(f"{where}: pooling must be one of {POOLINGS}, found {f.get('pooling')!r}")
        if f.get("layout") not in LAYOUTS:
            fail(f"{where}: layout must be one of {LAYOUTS}, found {f.get('layout')!r}")
        for step in f.get("transform", []):
            if step.get("op") not in TRANSFORMS:
                fail(f"{where}: transform must be one of {TRANSFORMS}, found {step!r}")
    for k in manifest.get("kjts", []):
        by_key = k.get("lengths_by_key") or []
        if by_key and len(by_key) != len(k.get("keys", [])):
            fail(f"KJT {k.get('name')!r}: lengths_by_key must name one tensor per key")
    for name in manifest["dense"].get("inputs", []):
        if name not in inputs and name not in boundary:
            fail(f"dense input {name!r} is neither a model input nor a boundary tensor")
    for dtype, entry in (manifest["dense"].get("dtypes") or {}).items():
        if dtype not in DENSE_DTYPES or not isinstance(entry, dict):
            fail(f"dense.dtypes: expected {DENSE_DTYPES.expected()} to an object, found {dtype!r}")
        if not isinstance(entry.get("approved"), bool):
            fail(f"dense.dtypes.{dtype}.approved: expected true or false, found {entry!r}")
    for name in per_request_inputs(manifest):
        if name not in manifest["dense"].get("inputs", []):
            fail(f"dense.batched names per-request input {name!r}, not a dense input")


def reads_rows(feature: dict) -> bool:
    """A KJT key read row by row (TorchRec's EmbeddingCollection): its rows cross unpooled."""
    return feature.get("layout") == "kjt" and feature.get("pooling") == "none"


def per_request_inputs(manifest: dict) -> list[str]:
    """The dense inputs the bundle's batched program takes expanded to each request's rows
    (cleave.partitioner.batched); empty when the bundle has no batched program."""
    batched = manifest["dense"].get("batched") or {}
    return list(batched.get("per_request", [])) if batched.get("program") else []


def served_dtypes(manifest: dict) -> list[str]:
    """The dense dtypes a ranker may serve (docs/bundle.md, "Dense precision"): those the
    partitioner approved (`dense.dtypes`, float32 first), else the one it was partitioned at."""
    dense = manifest["dense"]
    listed = dense.get("dtypes")
    if listed:
        return [d for d in DENSE_DTYPES if listed.get(d, {}).get("approved")]
    return [dense.get("dtype", "float32")]


def dtype_accuracy(manifest: dict, dtype: str) -> dict:
    """What the partitioner measured of the `dtype` program against float32 ({} for float32)."""
    dense = manifest["dense"]
    if dense.get("dtypes"):
        return dense["dtypes"].get(dtype, {}).get("accuracy") or {}
    return (dense.get("accuracy") or {}) if dtype == dense.get("dtype", "float32") else {}
