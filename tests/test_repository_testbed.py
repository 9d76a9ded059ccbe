"""A repository plan on the testbed (docs/plan.md, "Repository plans"; docs/repository.md,
"Plans and runners"): `cleave plan REPO` over 4 emulated hosts carries dlrm version 1 (shard
replicas 2 on the two shard hosts, 2 rankers); `cleave serve --plan --runner testbed` runs it,
and tritonclient, unmodified, over HTTP and gRPC: the repository index, a load of version 2
(placed on the plan's hosts with its shape), inference on explicit versions and on the
default, each version's scores its model's within 1e-5, an unload of version 1, the index
again, and version 1 loaded again. One deployment, one ranker thread each (the machine is
shared)."""

from __future__ import annotations

import pytest
import tritonclient.grpc as grpcclient
from cleave.launch.process import ServeProcess
from cleave.plan import load_plan
from cleave.testbed import commands
from support.repository import (
    http_client,
    infer_version,
    plan_repository,
    repository_index,
    version_1_of_2,
)
from support.served import TOLERANCE, grpc_target
from support.testbed import host_addresses
from support.waiting import wait_for

pytestmark = [
    pytest.mark.testbed,
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
    pytest.mark.skipif(commands.unavailable() is not None, reason=commands.unavailable() or ""),
]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """dlrm 1, and 2 (other dense weights and table emb_l_0); the plan carries 1 only."""
    root = tmp_path_factory.mktemp("repo")
    return root, version_1_of_2(root)


@pytest.fixture(scope="module")
def server(repo, tmp_path_factory):
    root, _ = repo
    flags = ["--hosts", "4", "--shards", "1", "--replicas", "2", "--rankers", "2"]
    plan = plan_repository(root, tmp_path_factory.mktemp("plan"), *flags)
    with ServeProcess(None, "--plan", str(plan), "--runner", "testbed", "--grpc-port", "0") as s:
        yield s, load_plan(plan)


def _where(server) -> dict[str, str]:
    """Role name -> the host address its metrics URL is on (the lines `cleave serve` logs)."""
    out = {}
    for line in list(server.log):
        words = line.split()
        if len(words) == 5 and words[2] == "metrics":
            out[words[3]] = words[4].removeprefix("http://").rsplit(":", 1)[0]
    return out


def test_versions_load_serve_and_unload_across_hosts(server, repo):
    server, plan = server
    _, dlrm = repo
    assert server.url.startswith("http://198.1"), server.url
    address = host_addresses(server)
    shard_hosts = {address[s.host] for s in plan.shards}
    assert len(shard_hosts) == 2  # the replicas of each range on distinct hosts
    ranker_hosts = {address[r.host] for r in plan.rankers}
    where = _where(server)
    assert {where[s.name] for s in plan.shards} == shard_hosts
    assert {where[r.name] for r in plan.rankers} == ranker_hosts
    grpc = grpcclient.InferenceServerClient(url=grpc_target(server))
    with http_client(server) as http:
        for client in (http, grpc):
            assert repository_index(client) == {
                ("dlrm", "1"): "READY",
                ("dlrm", "2"): "UNAVAILABLE",
            }

        # Loaded through the API: placed on the plan's hosts with its shape, its own table only.
        http.load_model("dlrm", query_params={"version": "2"})
        # `cleave serve` logged where version 2's roles are before the load answered.
        staged = "dlrm version 2: 2 rankers, 2 new shards; tables served already: "
        wait_for(lambda: any(staged in line for line in server.log), "version 2's roles", 30)
        where = _where(server)
        mine = {name: a for name, a in where.items() if name.startswith("dlrm-2-")}
        assert {a for n, a in mine.items() if "-shard-" in n} == shard_hosts
        assert len([n for n in mine if "-shard-" in n]) == 2
        assert {a for n, a in mine.items() if "-ranker-" in n} == ranker_hosts
        line = next(line for line in server.log if staged in line)
        shared = set(line.split(staged)[1].split(", "))
        assert "emb_l_0" not in shared and "emb_l_1" in shared  # its own table, only
        for client in (http, grpc):
            assert repository_index(client) == {("dlrm", "1"): "READY", ("dlrm", "2"): "READY"}
            for version in ("1", "2"):
                served, error = infer_version(client, dlrm, version=version)
                assert served == version and error <= TOLERANCE, (client, version, error)
            # No version named: the default, the highest loaded at start.
            served, error = infer_version(client, dlrm)
            assert served == "1" and error <= TOLERANCE

        http.unload_model("dlrm", query_params={"version": "1"})
        for client in (http, grpc):
            assert repository_index(client) == {
                ("dlrm", "1"): "UNAVAILABLE",
                ("dlrm", "2"): "READY",
            }
            # Version 2 serves on, on version 1's shards for the tables they share; the
            # default moved to it.
            for version in ("2", ""):
                served, error = infer_version(client, dlrm, version=version)
                assert served == "2" and error <= TOLERANCE, (client, version, error)
        # Loaded again: its old shards still hold the tables version 2 shares, so its table
        # of its own gets shards of new names and ports beside them.
        http.load_model("dlrm", query_params={"version": "1"})
        served, error = infer_version(http, dlrm, version="1")
        assert served == "1" and error <= TOLERANCE
    grpc.close()
    assert server.stop() == 0
