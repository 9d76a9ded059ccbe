"""Row updates on a served model repository (docs/repository.md, "Row updates"): `cleave update
--repository` reaches the shards of the version it names, every version sharing the table
serves the new rows, a version loaded afterwards with the bundle's table gets a copy of its
own, and a restarted shard comes back at its updated version (its state directory); `cleave
stream --repository` finds one version's shards.

One deployment for the module: dlrm versions 1 and 2, which differ only in their dense
weights and so share every table."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cleave.bench.loadgen import outputs_of
from cleave.launch.process import ServeProcess
from cleave.runners.membership import members
from cleave.stream.consumer import Deployment, StreamError
from cleave.update import write_delta
from support.client import post
from support.processes import processes_below
from support.repository import Versions, max_error, plan_repository
from support.served import TOLERANCE
from support.waiting import wait_for

pytestmark = pytest.mark.slow

TABLE, PARAMETER = "emb_l_0", "emb_l.0.weight"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    dlrm = Versions(root, "dlrm")
    dlrm.write(1)
    dlrm.write(2, dense=0.1)
    return root, dlrm


@pytest.fixture(scope="module")
def server(repo, tmp_path_factory):
    config = tmp_path_factory.mktemp("config") / "serve.toml"
    config.write_text("[router]\nbudget_ms = 20000\nshed = false\n")
    with ServeProcess(repo[0], "--config", str(config), "--threads", "1") as server:
        yield server


def _error(server, dlrm: Versions, version: str) -> float:
    """One request to `version`: its scores' distance from that version's model now."""
    body, want = dlrm.requests(1)[0]
    status, reply = post(f"{server.url}/v2/models/dlrm/versions/{version}/infer", body)
    assert status == 200, reply
    assert reply["model_version"] == version
    got = [o.astype(np.float64) for o in outputs_of(reply)]
    return max_error(got, want[version])


def _update(server, served: Path, *flags: str) -> subprocess.CompletedProcess:
    """`cleave update` of what `served` names: a repository, or (a .yaml) its plan."""
    which = "--plan" if served.suffix == ".yaml" else "--repository"
    return subprocess.run(
        [sys.executable, "-m", "cleave.cli", "update", which, str(served)]
        + ["--router", server.url, "--switch-margin-ms", "300", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _shard_pids(server, name: str) -> list[int]:
    return [
        pid
        for pid, argv in processes_below(server.proc.pid).items()
        if any(arg.endswith(f"/state/{name}") for arg in argv)
    ]


def test_an_update_reaches_every_version_sharing_the_table(server, repo, tmp_path):
    root, dlrm = repo
    for version in ("1", "2"):
        assert _error(server, dlrm, version) <= TOLERANCE
    manifest = json.loads((root / "dlrm" / "1" / "manifest.json").read_text())
    table = next(t for t in manifest["tables"] if t["name"] == TABLE)
    old = dict(dlrm.models[1].named_parameters())[PARAMETER].detach().clone()
    ids = np.arange(0, table["rows"], 2)
    new = old[ids].numpy() + 0.05
    delta = write_delta(tmp_path / "rows.delta", table, ids, new)

    dlrm.write(3, dense=0.2)  # from the base model: the old rows; not served yet
    done = _update(server, root, "--model", "dlrm", "--version", "1", "--table", TABLE)
    assert done.returncode != 0 and "--rows" in done.stderr  # what to write is required
    flags = ["--model", "dlrm", "--table", TABLE, "--rows", str(delta)]
    done = _update(server, root, *flags, "--version", "9")
    assert done.returncode != 0 and "dlrm/9" in done.stderr, done.stderr  # no such bundle
    done = _update(server, root, *flags, "--version", "3")
    assert done.returncode != 0 and "version 3 is not served" in done.stderr, done.stderr
    done = _update(server, root, *flags[2:], "--version", "1")
    assert done.returncode != 0 and "--model" in done.stderr, done.stderr

    # Through a repository plan of it (`cleave update --plan`), as a plan's deployment is.
    plan = plan_repository(root, tmp_path, "--hosts", "1")
    done = _update(server, plan, *flags[2:], "--version", "1")
    assert done.returncode != 0 and "a repository plan) needs --model" in done.stderr
    done = _update(server, plan, *flags, "--version", "1")
    assert done.returncode == 0, done.stderr
    for version in (1, 2):  # one table, stored once: both versions now have the new rows
        with torch.no_grad():
            dict(dlrm.models[version].named_parameters())[PARAMETER][ids] = torch.from_numpy(new)
    for version in ("1", "2"):
        assert _error(server, dlrm, version) <= TOLERANCE

    # A version loaded now whose table is the bundle's gets a copy of its own.
    status, reply = post(f"{server.url}/v2/repository/models/dlrm/load?version=3", {})
    assert status == 200, reply
    assert any("dlrm version 3: 1 rankers, 1 new shards" in line for line in server.log)
    for version in ("1", "2", "3"):
        assert _error(server, dlrm, version) <= TOLERANCE

    # A shard killed comes back at its updated version.
    (pid,) = _shard_pids(server, "dlrm-1-shard-0")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: len(set(_shard_pids(server, "dlrm-1-shard-0")) - {pid}) == 1, "a new shard")
    body = dlrm.requests(1)[0][0]
    url = f"{server.url}/v2/models/dlrm/versions/1/infer"
    wait_for(lambda: post(url, body)[0] == 200, "version 1 answering again")
    assert _error(server, dlrm, "1") <= TOLERANCE


def test_a_stream_follows_the_shards_of_one_version(server, repo):
    """`cleave stream --repository` checks records against the version's bundle and applies
    them where the router serves that version's tables (the Kafka side: test_stream.py)."""
    root, _ = repo
    args = argparse.Namespace(
        plan=None, bundle=None, repository=str(root), name="dlrm", model_version="2",
        router=server.url, admin_token_env="",
    )  # fmt: skip
    target = Deployment.from_args(args)
    manifest = json.loads((root / "dlrm" / "2" / "manifest.json").read_text())
    assert target.tables.keys() == {t["name"] for t in manifest["tables"]}
    (served,) = [v for v in members(server.url)["versions"] if v["version"] == "2"]
    holding = [s["addr"] for s in served["shards"] if TABLE in {r["table"] for r in s["ranges"]}]
    assert target.shards(TABLE) == holding and holding
    with pytest.raises(StreamError, match="--name MODEL"):
        Deployment.from_args(argparse.Namespace(**{**vars(args), "name": None}))
