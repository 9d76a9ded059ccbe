"""`cleave update` through `cleave serve` under load (docs/tiers.md, "Updates"): a client
keeps sending requests while a table is updated on every shard; none fails, and afterwards
the scores are those of a deployment of the bundle with the new rows."""

from __future__ import annotations

import json
import shutil
import zlib

import cleave
import numpy as np
import pytest
from cleave.bench.loadgen import infer_body
from cleave.launch.process import ServeProcess
from cleave.models import MODELS, RequestGenerator
from cleave.update import write_delta
from support.updates import Load, run_update, scores, updatable_plan


@pytest.mark.slow  # a 2 x 2 replica deployment updated under load
def test_update_under_load_fails_no_request(tmp_path):
    model, example = MODELS["dlrm"].factory(scale=0.01, seed=0)
    model.eval()
    partitioned = cleave.partition(model, example)
    bundle = partitioned.save(tmp_path / "dlrm")
    tables = json.loads((bundle / "manifest.json").read_text())["tables"]
    table = max(tables, key=lambda t: t["rows"])
    assert table["dtype"] == "float32", table
    # New rows for every id: any request that reads the table sees the update.
    rng = np.random.default_rng(5)
    ids = np.arange(table["rows"])
    rows = rng.standard_normal((table["rows"], table["dim"])).astype(np.float32)
    delta = write_delta(tmp_path / "new.delta", table, ids, rows)
    fresh = tmp_path / "fresh" / bundle.name
    shutil.copytree(bundle, fresh)
    (fresh / table["file"]).write_bytes(rows.tobytes())
    manifest = json.loads((fresh / "manifest.json").read_text())
    for t in manifest["tables"]:
        if t["name"] == table["name"]:
            t["crc32"] = zlib.crc32(rows.tobytes())
    (fresh / "manifest.json").write_text(json.dumps(manifest))

    plan_path, plan = updatable_plan(bundle, tmp_path / "plan.yaml", replicas=2)
    generator = RequestGenerator("dlrm", scale=0.01, seed=7, min_pooling=1)
    bodies = [infer_body(partitioned.named_inputs(*generator.batch(b))) for b in (1, 8)]
    with ServeProcess(None, "--plan", str(plan_path)) as server:
        url = f"{server.url}/v2/models/{plan.name}/infer"
        before = scores(url, bodies)
        with Load(url, bodies) as traffic:
            proc = run_update(plan_path, table["name"], delta, server.url)
            traffic.more(5)
        assert proc.returncode == 0, proc.stderr
        versions = json.loads(proc.stdout)["versions"]
        assert len(versions) == 4 and set(versions.values()) == {1}, versions  # 2 x 2 replicas
        after = scores(url, bodies)
    failed = [(status, reply) for _, status, reply in traffic.sent if status != 200]
    assert failed == [] and len(traffic.sent) > 5
    assert after != before
    with ServeProcess(fresh, "--shards", "2") as server:
        assert scores(f"{server.url}/v2/models/{fresh.name}/infer", bodies) == after
