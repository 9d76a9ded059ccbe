"""The partitioner and the bundle format: round trips, shapes, quantization, errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import cleave
import factories
import numpy as np
import pytest
import torch
from cleave.bundle import tables as table_io
from cleave.models import MODELS
from support.cli import refused
from support.served import SCALES as SERVED_SCALES

# Small scales keep the suite fast; the shapes and code paths are those of the full models.
# (TorchRec's reference models are tests/test_torchrec.py's.) The tests of the session's
# bundles (`models`, partitioned once for every worker) use their scales.
SCALES = {"dlrm": 0.001, "dcn": 0.0001, "din": 0.001, "shared": 0.01}


@pytest.fixture(scope="module")
def bundles(models):
    """Each reference model, partitioned, saved and loaded back (the session's)."""
    return {name: (models[name].model, models[name].bundle) for name in SERVED_SCALES}


def fresh_inputs(name: str, batch: int, seed: int) -> tuple:
    """Other batch sizes and bag lengths than the example, with empty bags and repeats."""
    gen = MODELS[name].generator(scale=SERVED_SCALES[name], alpha=1.2, min_pooling=0, seed=seed)
    return gen.batch(batch)


@pytest.mark.parametrize("name", sorted(SERVED_SCALES))
def test_reference_equals_model_on_fresh_inputs(bundles, name):
    model, bundle = bundles[name]
    for batch, seed in [(1, 11), (3, 12), (29, 13)]:
        x = fresh_inputs(name, batch, seed)
        with torch.no_grad():
            want = model(*x)
            got = bundle.reference(*x)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-5, (name, batch)


def test_fresh_inputs_have_empty_bags_and_repeated_ids(bundles):
    _, bundle = bundles["dlrm"]
    x = fresh_inputs("dlrm", 29, 13)
    named = bundle.named_inputs(*x)
    lengths = [
        np.diff(np.append(named[f"lS_o_{i}"].numpy(), len(named[f"lS_i_{i}"]))) for i in range(26)
    ]
    assert any((lens == 0).any() for lens in lengths)
    ids = torch.cat([named[f"lS_i_{i}"] % 16 for i in range(26)])
    assert len(torch.unique(ids)) < len(ids)


def test_manifest_describes_the_seam(bundles):
    _, dlrm = bundles["dlrm"]
    m = dlrm.manifest
    assert [i["name"] for i in m["inputs"]][:3] == ["dense_x", "lS_i_0", "lS_i_1"]
    assert m["inputs"][0] == {
        "name": "dense_x",
        "dtype": "float32",
        "shape": ["B", 13],
        "role": "dense",
    }
    assert len(m["tables"]) == 26 and all(t["dim"] == 16 for t in m["tables"])
    f0 = m["features"][0]
    assert f0["layout"] == "offsets" and f0["pooling"] == "sum" and f0["offsets"] == "lS_o_0"
    assert f0["transform"] == [{"op": "remainder", "divisor": m["tables"][0]["rows"]}]
    assert m["boundary"][0] == {"name": "lS_i_0_pooled", "dtype": "float32", "shape": ["B", 16]}
    assert m["dense"]["inputs"][0] == "dense_x" and len(m["dense"]["inputs"]) == 27
    assert m["outputs"] == [{"name": "output_0", "dtype": "float32", "shape": ["B", 1]}]
    assert m["shared_inputs"] == []


def test_shared_inputs_found_from_the_graph(bundles):
    _, din = bundles["din"]
    assert set(din.manifest["shared_inputs"]) == {"user_hist", "profile_ids", "profile_offsets"}


def test_features_sharing_a_table_keep_sharing_it(bundles):
    _, shared = bundles["shared"]
    m = shared.manifest
    by_table = {}
    for f in m["features"]:
        by_table.setdefault(f["table"], []).append(f["name"])
    assert max(len(v) for v in by_table.values()) >= 2
    weighted = [f for f in m["features"] if f["weights"]]
    assert weighted and all(f["pooling"] == "sum" for f in weighted)
    assert {f["pooling"] for f in m["features"]} >= {"sum", "mean", "max"}


def test_capture_tolerates_python_control_flow_lists_and_constants(tmp_path):
    model, example = factories.shape_control_flow()
    bundle = cleave.partition(model, example)
    m = bundle.manifest
    assert [i["name"] for i in m["inputs"]] == [
        "dense",
        "ids_0",
        "ids_1",
        "ids_2",
        "offsets_0",
        "offsets_1",
        "offsets_2",
    ]
    assert any(name.startswith("_folded_") for name, _ in bundle.dense_program.named_buffers())
    bundle.save(tmp_path / "b")
    loaded = cleave.load_bundle(tmp_path / "b")
    ids = [torch.randint(0, 10_000, (n,)) for n in (0, 3, 12)]
    offsets = [
        torch.zeros(6, dtype=torch.int64),
        torch.tensor([0, 0, 1, 1, 2, 3]),
        torch.tensor([0, 4, 4, 8, 9, 12]),
    ]
    x = (torch.randn(6, 4), ids, offsets)
    want, got = model(*x), loaded.reference(*x)
    assert isinstance(got, tuple) and len(got) == 2
    for w, g in zip(want, got, strict=True):
        assert (w - g).abs().max().item() <= 1e-5


@pytest.mark.parametrize("length, expect", [(6, ["fixed", "fixed"]), (2, ["gather"])])
def test_size_aware_transfer(length, expect):
    model, example = factories.per_position(length)
    bundle = cleave.partition(model, example)
    assert [f["layout"] for f in bundle.manifest["features"]] == expect
    x = (torch.randint(0, 40, (7, length)),)
    assert (bundle.reference(*x) - model(*x)).abs().max().item() <= 1e-5


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    pos = labels == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def test_int8_tables_keep_pooled_error_and_auc():
    model, example = MODELS["dlrm"].factory(scale=SCALES["dlrm"], seed=1)
    fp32 = cleave.partition(model, example)
    int8 = cleave.partition(model, example, table_dtype="int8_rowwise")
    assert int8.manifest["tables"][0]["row_bytes"] == 16 + 8
    gen = MODELS["dlrm"].generator(scale=SCALES["dlrm"], seed=5)
    worst, scores32, scores8, labels = 0.0, [], [], []
    for x, y in gen.labelled(4096, batch_size=512, teacher=model):
        named = fp32.named_inputs(*x)
        p32, p8 = fp32.sparse_reference(named), int8.sparse_reference(named)
        for k in p32:
            norm = p32[k].norm(dim=1).clamp_min(1e-12)
            worst = max(worst, ((p8[k] - p32[k]).norm(dim=1) / norm).max().item())
        scores32.append(fp32.reference(*x).reshape(-1))
        scores8.append(int8.reference(*x).reshape(-1))
        labels.append(y)
    labels = torch.cat(labels).numpy()
    a32 = auc(torch.cat(scores32).detach().numpy(), labels)
    a8 = auc(torch.cat(scores8).detach().numpy(), labels)
    assert worst <= 0.01
    assert a32 > 0.6  # the labels carry signal, so the comparison means something
    assert abs(a32 - a8) <= 0.001


def test_float16_tables_round_trip(tmp_path):
    model, example = MODELS["shared"].factory(scale=SCALES["shared"], seed=1)
    cleave.partition(model, example, table_dtype="float16").save(tmp_path / "b")
    bundle = cleave.load_bundle(tmp_path / "b")
    x = fresh_inputs("shared", 9, 4)
    assert (bundle.reference(*x) - model(*x)).abs().max().item() <= 1e-2
    # Each table's content key is the SHA-256 of its file as written (docs/bundle.md).
    for t in bundle.manifest["tables"]:
        assert t["sha256"] == table_io.sha256_of(tmp_path / "b" / t["file"])


def test_table_encodings():
    w = np.array([[0.0, 1.0, -1.0, 0.5], [2.0, 2.0, 2.0, 2.0], [0, 0, 0, 0]], dtype=np.float32)
    for dtype, tol in [("float32", 0), ("float16", 1e-3), ("int8_rowwise", 2 / 255)]:
        raw = table_io.encode(w, dtype)
        assert raw.shape == (3, table_io.row_bytes(dtype, 4))
        assert np.abs(table_io.decode(raw, dtype, 4) - w).max() <= tol
    # A constant row decodes exactly.
    assert (table_io.decode(table_io.encode(w, "int8_rowwise"), "int8_rowwise", 4)[1] == 2.0).all()


# -- unsupported models: a Cleave error that names the operator and the reason ----------------
@pytest.mark.parametrize(
    "factory, words",
    [
        ("no_embedding", ["no embedding operator"]),
        ("value_branch", ["values", "ids.sum() > 5"]),
        ("cond_lookup", ["control flow", "cond"]),
        ("computed_ids", ["aten.add", "cannot run"]),
        ("padding_idx", ["padding_idx"]),
    ],
)
def test_unsupported_models_fail_clearly(factory, words):
    model, example = getattr(factories, factory)()
    with pytest.raises(cleave.UnsupportedModelError) as err:
        cleave.partition(model, example)
    for word in words:
        assert word in str(err.value)


def test_bad_arguments_fail_clearly():
    model, example = factories.per_position()
    with pytest.raises(cleave.UnsupportedModelError, match="tuple"):
        cleave.partition(model, list(example))
    with pytest.raises(cleave.UnsupportedModelError, match="int"):
        cleave.partition(model, (example[0], 3))
    with pytest.raises(cleave.BundleError, match="table dtype"):
        cleave.partition(model, example, table_dtype="int2")


# -- bundle files -----------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    model, example = factories.per_position()
    path = cleave.partition(model, example).save(tmp_path / "b")
    return path


def test_save_is_atomic(tmp_path, monkeypatch):
    model, example = factories.per_position()
    bundle = cleave.partition(model, example)

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch.export, "save", broken_save)
    with pytest.raises(OSError):
        bundle.save(tmp_path / "b")
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_to_overwrite_unless_asked(saved):
    bundle = cleave.load_bundle(saved)
    with pytest.raises(cleave.BundleError, match="already exists"):
        bundle.save(saved)
    bundle.save(saved, overwrite=True)
    assert cleave.load_bundle(saved).manifest == bundle.manifest
    assert sorted(p.name for p in saved.parent.iterdir()) == ["b"]


def edit_manifest(path: Path, **changes):
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.update(changes)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_future_version_is_refused(saved):
    edit_manifest(saved, version=99)
    with pytest.raises(cleave.BundleError, match=r"manifest.json.*version 99.*version 1"):
        cleave.load_bundle(saved)


def test_corrupted_bundles_name_the_file(saved):
    table = next((saved / "tables").iterdir())
    data = bytearray(table.read_bytes())
    data[5] ^= 0xFF
    table.write_bytes(bytes(data))
    with pytest.raises(cleave.BundleError, match=f"{table.name}.*CRC-32"):
        cleave.load_bundle(saved)
    table.write_bytes(bytes(data[:-4]))
    with pytest.raises(cleave.BundleError, match=f"{table.name}.*bytes"):
        cleave.load_bundle(saved)
    (saved / "manifest.json").write_text("{not json")
    with pytest.raises(cleave.BundleError, match="manifest.json.*not valid JSON"):
        cleave.load_bundle(saved)


def test_missing_or_damaged_dense_program(saved):
    (saved / "dense.pt2").write_bytes(b"garbage")
    with pytest.raises(cleave.BundleError, match="dense.pt2"):
        cleave.load_bundle(saved)
    (saved / "dense.pt2").unlink()
    with pytest.raises(cleave.BundleError, match="dense.pt2.*missing"):
        cleave.load_bundle(saved)


def test_not_a_bundle(tmp_path):
    with pytest.raises(cleave.BundleError, match="not found"):
        cleave.load_bundle(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(cleave.BundleError, match="expected format 'cleave-bundle'"):
        cleave.load_bundle(tmp_path)


# -- the command line ---------------------------------------------------------------------------
def cli(*args, cwd=None):
    env_path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "cleave.cli", "partition", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": env_path},
        timeout=300,
    )


def test_cli_partitions_and_summarizes(tmp_path):
    out = tmp_path / "bundle"
    result = cli("--model", "factories:shape_control_flow", "-o", str(out), "--table-dtype", "int8")
    assert result.returncode == 0, result.stderr
    assert "sparse side: 3 tables" in result.stdout and "boundary:" in result.stdout
    assert cleave.load_bundle(out).manifest["tables"][0]["dtype"] == "int8_rowwise"
    again = refused("partition", "--model", "factories:shape_control_flow", "-o", str(out))
    assert "already exists" in again


@pytest.mark.parametrize(
    "spec, message",
    [
        ("factories", "PKG.MODULE:FACTORY"),
        ("no_such_module:f", "cannot import module 'no_such_module'"),
        ("factories:missing", "no callable 'missing'"),
        ("factories:raises", "RuntimeError: checkpoint not found"),
        ("factories:wrong_type", "must return (torch.nn.Module, tuple"),
        ("factories:no_embedding", "no embedding operator"),
    ],
)
def test_cli_bad_input_exits_2_without_traceback(tmp_path, spec, message):
    # In this process (tests/support/cli.py); the exit status of the process itself is
    # test_cli_partitions_and_summarizes's.
    stderr = refused("partition", "--model", spec, "-o", str(tmp_path / "b"))
    assert message in stderr
    assert "Traceback" not in stderr
    assert not (tmp_path / "b").exists()
    shutil.rmtree(tmp_path, ignore_errors=True)
