"""A model repository on disk (python/cleave/bundle/repository.py): what is a version, version
policies in both their forms, table content keys."""

from __future__ import annotations

import json

import pytest
from cleave.bundle.repository import (
    VersionPolicy,
    is_repository,
    model_policy,
    scan,
    table_keys,
)
from cleave.bundle.tables import sha256_of
from cleave.errors import UsageError


def _bundle(path, tables=(("t0", b"\x01" * 64),)):
    (path / "tables").mkdir(parents=True)
    metas = []
    for name, data in tables:
        (path / "tables" / f"{name}.bin").write_bytes(data)
        metas.append(
            {"name": name, "file": f"tables/{name}.bin", "rows": len(data) // 16, "dim": 4}
            | {"dtype": "float32", "row_bytes": 16, "crc32": 0}
        )
    (path / "manifest.json").write_text(json.dumps({"tables": metas}))
    return path


def test_scan_finds_numbered_versions_only(tmp_path):
    for d in ("a/1", "a/3", "a/10", "a/latest", "a/0", "b/2", "c/notes", ".cleave/1"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "a" / "README").write_text("not a version")
    models = scan(tmp_path)
    assert {m: sorted(v) for m, v in models.items()} == {"a": [1, 3, 10], "b": [2]}
    assert models["a"][10] == tmp_path / "a" / "10"
    assert is_repository(tmp_path)
    assert not is_repository(_bundle(tmp_path / "x"))


def test_scan_of_a_missing_directory_says_so(tmp_path):
    with pytest.raises(UsageError, match="not a directory"):
        scan(tmp_path / "nope")


@pytest.mark.parametrize(
    "value, present, selected",
    [
        ({"all": {}}, [1, 2, 3], [1, 2, 3]),
        ({"all": True}, [3, 1], [1, 3]),
        ({"latest": {"num_versions": 2}}, [1, 5, 3], [3, 5]),
        ({"latest": 1}, [1, 2], [2]),
        ({"specific": {"versions": [1, 3, 7]}}, [1, 2, 3], [1, 3]),
        ({"specific": [2]}, [1, 2], [2]),
    ],
)
def test_policies_select_as_tritons_do(value, present, selected):
    assert VersionPolicy.parse(value, "here").select(present) == selected


@pytest.mark.parametrize(
    "value",
    [
        {},
        {"latest": {"num_versions": 0}},
        {"latest": {"num_versions": True}},
        {"specific": {"versions": []}},
        {"specific": {"versions": ["1"]}},
        {"all": {}, "latest": 1},
        {"newest": 1},
        "all",
    ],
)
def test_malformed_policies_are_refused_naming_what_was_expected(value):
    with pytest.raises(UsageError, match="version_policy: expected one of"):
        VersionPolicy.parse(value, "config")


def test_model_toml_gives_the_policy(tmp_path):
    (tmp_path / "m").mkdir()
    assert model_policy(tmp_path, "m") == VersionPolicy()
    (tmp_path / "m" / "model.toml").write_text("[version_policy]\nlatest = 2\n")
    assert model_policy(tmp_path, "m").select([1, 2, 3]) == [2, 3]
    (tmp_path / "m" / "model.toml").write_text("version_policy = { specific = [1] }\n")
    assert model_policy(tmp_path, "m").select([1, 2]) == [1]
    (tmp_path / "m" / "model.toml").write_text("policy = 1\n")
    with pytest.raises(UsageError, match="unknown keys \\['policy'\\]"):
        model_policy(tmp_path, "m")
    (tmp_path / "m" / "model.toml").write_text("[version_policy\n")
    with pytest.raises(UsageError, match="cannot be read as TOML"):
        model_policy(tmp_path, "m")


def test_table_keys_use_the_recorded_hash_else_hash_the_file(tmp_path):
    bundle = _bundle(tmp_path / "b", (("t0", b"\x01" * 64), ("t1", b"\x02" * 32)))
    manifest = json.loads((bundle / "manifest.json").read_text())
    keys = table_keys(bundle, manifest)
    assert keys["t0"].sha256 == sha256_of(bundle / "tables" / "t0.bin")
    assert keys["t0"] != keys["t1"]
    assert (keys["t0"].rows, keys["t0"].dim, keys["t0"].dtype) == (4, 4, "float32")
    manifest["tables"][0]["sha256"] = "recorded"
    assert table_keys(bundle, manifest)["t0"].sha256 == "recorded"
