"""`cleave update` through `cleave serve` under load (docs/tiers.md, "Updates"): a client
keeps sending requests while a table is updated on every shard; none fails, and afterwards
the scores are those of a deployment of the bundle with the new rows."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib

import cleave
import numpy as np
import pytest
from cleave.bench.loadgen import infer_body, outputs_of
from cleave.launch.process import ServeProcess
from cleave.models import MODELS, RequestGenerator
from cleave.plan.files import load_plan, save_plan
from cleave.update import write_delta


def post(url: str, body: bytes) -> tuple[int, dict | str]:
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")
    except OSError as err:
        return 0, str(err)


def scores(url: str, bodies) -> list[bytes]:
    replies = [post(url, b) for b in bodies]
    assert all(s == 200 for s, _ in replies), replies
    return [b"".join(o.tobytes() for o in outputs_of(r)) for _, r in replies]


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

    plan_path = tmp_path / "plan.yaml"
    subprocess.run(
        [sys.executable, "-m", "cleave.cli", "plan", str(bundle), "--hosts", "4"]
        + ["--shards", "2", "--replicas", "2", "-o", str(plan_path)],
        check=True,
        capture_output=True,
    )
    plan = load_plan(plan_path)
    for shard in plan.shards:
        shard.state_dir = f"state/{shard.name}"
        shard.threads = 1
    for role in [*plan.shards, *plan.rankers]:
        role.port = role.metrics_port = 0  # free ports: other tests may hold the plan's
    for router in plan.routers:
        router.http_port = 0
    save_plan(plan, plan_path)

    generator = RequestGenerator("dlrm", scale=0.01, seed=7, min_pooling=1)
    bodies = [infer_body(partitioned.named_inputs(*generator.batch(b))) for b in (1, 8)]
    statuses, stop = [], threading.Event()
    with ServeProcess(None, "--plan", str(plan_path)) as server:
        url = f"{server.url}/v2/models/{plan.name}/infer"
        before = scores(url, bodies)

        def load():
            deadline = time.monotonic() + 60
            while not stop.is_set() and time.monotonic() < deadline and len(statuses) < 20000:
                statuses.append(post(url, bodies[len(statuses) % 2]))

        thread = threading.Thread(target=load)
        thread.start()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "cleave.cli", "update", "--plan", str(plan_path)]
                + ["--table", table["name"], "--rows", str(delta), "--router", server.url],
                capture_output=True,
                text=True,
                timeout=60,
            )
            during = len(statuses)
            while len(statuses) < during + 5 and thread.is_alive():
                time.sleep(0.01)
        finally:
            stop.set()
            thread.join()
        assert proc.returncode == 0, proc.stderr
        versions = json.loads(proc.stdout)["versions"]
        assert len(versions) == 4 and set(versions.values()) == {1}, versions  # 2 x 2 replicas
        after = scores(url, bodies)
    failed = [s for s in statuses if s[0] != 200]
    assert failed == [] and len(statuses) > 5
    assert after != before
    with ServeProcess(fresh, "--shards", "2") as server:
        assert scores(f"{server.url}/v2/models/{fresh.name}/infer", bodies) == after
