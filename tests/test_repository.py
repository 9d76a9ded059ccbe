"""`cleave serve REPO` (docs/repository.md): several models and versions in one deployment,
driven by Triton's own clients (HTTP and gRPC, unmodified): the repository index, loads and
unloads, inference on explicit and default versions, each version's scores its model's;
tables shared between versions and models; loads that fail leave nothing behind; a load and an
unload whose clients leave still finish; a canary,
promotion, rollback and unload under load with no failed request; the rollout state through a
router restart.

One deployment for the module (its tests run in order): dlrm versions 1 and 2 (2 changes the
dense weights and one table) and dlrm-b version 1 (other dense weights, every table dlrm's);
the last test serves a repository plan of its own on the local runner.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from cleave.bench.stages import gauge
from cleave.launch.process import ServeProcess
from cleave.repository.deployment import ROLLOUT_FILE
from support.client import closed_loop, post
from support.processes import get, processes_below
from support.repository import (
    Versions,
    break_probe,
    corrupt,
    http_client,
    infer_version,
    max_error,
    repository_index,
)
from support.served import TOLERANCE, grpc_target
from support.waiting import wait_for
from tritonclient.utils import InferenceServerException

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
]

SHARD_MARGIN = 64 << 20  # cleave.plan.check.SHARD_MARGIN_BYTES


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    dlrm, other = Versions(root, "dlrm"), Versions(root, "dlrm-b")
    v1 = dlrm.write(1)
    dlrm.write(2, dense=0.1, table="emb_l.0.weight")
    other.write(1, dense=0.2)
    tables = json.loads((v1 / "manifest.json").read_text())["tables"]
    size = {t["name"]: t["rows"] * t["row_bytes"] for t in tables}
    return root, dlrm, other, size


@pytest.fixture(scope="module")
def server(repo, tmp_path_factory):
    root, _, _, size = repo
    # The memory budget holds what starts (two shards: every table, then dlrm 2's emb_l_0)
    # and nothing more: a version that brings a table of its own does not fit.
    budget = sum(size.values()) + size["emb_l_0"] + 2 * SHARD_MARGIN + (1 << 20)
    config = tmp_path_factory.mktemp("config") / "serve.toml"
    config.write_text(
        f"table_memory_budget = {budget}\n[router]\nbudget_ms = 20000\nshed = false\n"
    )
    flags = ["--config", str(config), "--grpc-port", "0", "--threads", "1"]
    with ServeProcess(root, *flags) as server:
        yield server


def test_tritonclient_sees_every_version_and_each_scores_as_its_model(server, repo):
    _, dlrm, other, _ = repo
    grpc = grpcclient.InferenceServerClient(url=grpc_target(server))
    with http_client(server) as http:
        for client in (http, grpc):
            assert repository_index(client) == {
                ("dlrm", "1"): "READY",
                ("dlrm", "2"): "READY",
                ("dlrm-b", "1"): "READY",
            }
            for version in ("1", "2"):
                served, error = infer_version(client, dlrm, version=version)
                assert served == version and error <= TOLERANCE, (client, version, error)
            # No version named: the latest present at start.
            served, error = infer_version(client, dlrm)
            assert served == "2" and error <= TOLERANCE
            served, error = infer_version(client, other, model="dlrm-b")
            assert served == "1" and error <= TOLERANCE
        meta = http.get_model_metadata("dlrm")
        assert meta["versions"] == ["1", "2"]
        assert http.is_model_ready("dlrm", "1") and http.is_model_ready("dlrm-b")
        assert not http.is_model_ready("dlrm", "7")
        with pytest.raises(InferenceServerException, match="version"):
            infer_version(http, dlrm, version="7")
    grpc.close()


def _shard_tables(server) -> dict[str, set[str]]:
    """Each shard process's tables, from its /metrics (the URLs `cleave serve` logged)."""
    urls = {
        line.split()[3]: line.split()[4]
        for line in list(server.log)
        if " metrics " in line and "-shard-" in line
    }
    tables = {}
    for name, url in urls.items():
        status, text = get(url)
        if status != 200:
            continue  # a shard since stopped
        tables[name] = {
            part.split('table="')[1].split('"')[0]
            for part in text.splitlines()
            if part.startswith("cleave_shard_table_rows{")
        }
    return tables


def test_versions_and_models_share_the_tables_they_have_in_common(server, repo):
    _, _, _, size = repo
    tables = _shard_tables(server)
    # dlrm 1 brought every table; dlrm 2 only the one it changed; dlrm-b none.
    assert tables == {"dlrm-1-shard-0": set(size), "dlrm-2-shard-0": {"emb_l_0"}}
    log = "\n".join(server.log)
    assert "dlrm-b version 1: 1 rankers, 0 new shards" in log


def _processes(server) -> set[int]:
    return set(processes_below(server.proc.pid))


def _load_error(client, *args, **kwargs) -> str:
    with pytest.raises(InferenceServerException) as err:
        client.load_model(*args, **kwargs)
    return str(err.value)


def test_loads_that_fail_leave_nothing_behind(server, repo):
    root, dlrm, _, _ = repo
    before = _processes(server)
    corrupt(dlrm.write(4, dense=0.3))
    break_probe(dlrm.write(5, dense=0.4))
    dlrm.write(6, dense=0.5, table="emb_l.1.weight")  # a table of its own: over the budget
    with http_client(server) as http:
        message = _load_error(http, "dlrm", query_params={"version": "4"})
        assert "manifest.json" in message and "not valid JSON" in message
        message = _load_error(http, "dlrm", query_params={"version": "5"})
        assert "probe batch" in message
        message = _load_error(http, "dlrm", query_params={"version": "6"})
        assert "does not fit" in message and "table_memory_budget" in message
        assert "no model 'nope'" in _load_error(http, "nope")
        assert "no version 9" in _load_error(http, "dlrm", query_params={"version": "9"})
        bad = json.dumps({"version_policy": {"newest": 1}})
        assert "version_policy: expected one of" in _load_error(http, "dlrm", config=bad)
        # Nothing started stays; what served serves on, and nothing else does.
        assert _processes(server) == before
        index = repository_index(http)
        assert [index[("dlrm", v)] for v in "456"] == ["UNAVAILABLE"] * 3
        for version in ("1", "2"):
            served, error = infer_version(http, dlrm, version=version)
            assert served == version and error <= TOLERANCE
        for version in ("4", "5", "6"):
            with pytest.raises(InferenceServerException):
                infer_version(http, dlrm, version=version)


def test_a_second_load_of_a_loading_model_is_refused(server, repo):
    root, dlrm, _, _ = repo
    dlrm.write(3, dense=-0.1)  # dense weights only: rankers, no shard
    # A forked ranker starts in a tenth of a second: the load is held at its ranker's start,
    # the fork server stopped, so that the second load surely finds it loading.
    (fork_server,) = [
        pid
        for pid, argv in processes_below(server.proc.pid).items()
        if "cleave.launch.forkserver" in argv
    ]
    with http_client(server) as http:
        done = []
        first = threading.Thread(
            target=lambda: done.append(http_load(server, "dlrm", "3")), daemon=True
        )
        os.kill(fork_server, signal.SIGSTOP)
        try:
            first.start()
            with http_client(server) as other:
                started = "dlrm version 3: loading"
                wait_for(lambda: any(started in line for line in server.log), "v3 loading", 60)
                message = _load_error(other, "dlrm", query_params={"version": "3"})
        finally:
            os.kill(fork_server, signal.SIGCONT)
        assert "loading" in message
        first.join(120)
        assert done == [200]
        assert repository_index(http)[("dlrm", "3")] == "READY"
        served, error = infer_version(http, dlrm, version="3")
        assert served == "3" and error <= TOLERANCE
        # Loaded later, it takes no unversioned traffic by itself.
        assert infer_version(http, dlrm)[0] == "2"
    # Nothing a load started was killed (a child must outlive the thread that started it).
    assert not [line for line in server.log if "killed by SIGKILL" in line]


def test_a_load_and_an_unload_whose_clients_leave_still_finish(server, repo):
    """The admin client goes (a timeout, a closed socket) while the change is under way: the
    change still finishes, never leaving a version LOADING or UNLOADING for good."""
    _, dlrm, _, _ = repo
    dlrm.write(7, dense=-0.2)  # dense weights only: a ranker of its own
    pids = processes_below(server.proc.pid)
    (fork_server,) = [pid for pid, argv in pids.items() if "cleave.launch.forkserver" in argv]
    with http_client(server) as http:
        os.kill(fork_server, signal.SIGSTOP)  # holds the load at its ranker's start
        try:
            with _left_post(server, "/v2/repository/models/dlrm/load?version=7"):
                started = "dlrm version 7: loading"
                wait_for(lambda: any(started in line for line in server.log), "v7 loading", 60)
        finally:
            os.kill(fork_server, signal.SIGCONT)
        wait_for(lambda: repository_index(http)[("dlrm", "7")] == "READY", "v7 ready", 120)

        # A request held at v7's stopped ranker holds the unload in its drain.
        (ranker,) = [
            pid
            for pid, argv in processes_below(server.proc.pid).items()
            if "ranker" in argv and any(a.endswith("dlrm/7") for a in argv)
        ]
        served = []

        def infer_v7():
            with http_client(server) as client:
                served.append(infer_version(client, dlrm, version="7"))

        os.kill(ranker, signal.SIGSTOP)
        try:
            held = threading.Thread(target=infer_v7, daemon=True)
            held.start()
            metrics = f"{server.url}/metrics"
            wait_for(
                lambda: (gauge(metrics, "cleave_router_in_flight") or 0) >= 1,
                "the request at v7's ranker",
                60,
            )
            with _left_post(server, "/v2/repository/models/dlrm/unload?version=7"):
                wait_for(
                    lambda: repository_index(http).get(("dlrm", "7")) == "UNLOADING",
                    "v7 unloading",
                    60,
                )
        finally:
            os.kill(ranker, signal.SIGCONT)
        held.join(60)
        assert served and served[0][0] == "7" and served[0][1] <= TOLERANCE
        wait_for(lambda: repository_index(http)[("dlrm", "7")] == "UNAVAILABLE", "v7 unloaded", 60)
        wait_for(lambda: ranker not in processes_below(server.proc.pid), "v7's ranker stopped", 60)


@contextlib.contextmanager
def _left_post(server, path: str):
    """A POST whose client leaves without reading the answer once the block ends."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\n\r\n".encode())
        yield


def http_load(server, model, version) -> int:
    status, _ = post(f"{server.url}/v2/repository/models/{model}/load?version={version}", {})
    return status


def _keyed(server, dlrm, key: str) -> str:
    body, want = dlrm.requests(1)[0]
    request = urllib.request.Request(
        f"{server.url}/v2/models/dlrm/infer",
        data=body,
        headers={"content-type": "application/json", "cleave-request-key": key},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        reply = json.loads(response.read())
    version = reply["model_version"]
    got = [np.asarray(o["data"], dtype=np.float64).reshape(o["shape"]) for o in reply["outputs"]]
    assert max_error(got, want[version]) <= TOLERANCE
    return version


def _rollout(server, **body) -> dict:
    status, reply = post(f"{server.url}/admin/v1/rollout", body)
    assert status == 200, reply
    return reply


def test_canary_promotion_rollback_and_unload_under_load(server, repo):
    _, dlrm, _, _ = repo
    # Paced: 3 clients, each sending at most every 20 ms, through every change (a saturating
    # loop cost the suite 27 s of CPU in its client alone: docs/testing.md).
    url = f"{server.url}/v2/models/dlrm/infer"
    results, finish = closed_loop(url, dlrm.requests(6), pace_s=0.02)
    try:
        wait_for(lambda: len(results) > 5, "requests to flow", 60)
        _rollout(server, model="dlrm", version="3", percent=10)
        keys = [f"user-{i}" for i in range(40)]
        first = {key: _keyed(server, dlrm, key) for key in keys}
        assert {first[key] for key in keys} <= {"2", "3"}
        assert 0 < sum(v == "3" for v in first.values()) < len(keys)  # 10% of 40, stably
        assert all(_keyed(server, dlrm, key) == first[key] for key in keys[:10])

        _rollout(server, model="dlrm", version="3", percent=100)  # promoted
        assert {_keyed(server, dlrm, key) for key in keys[:5]} == {"3"}
        status, reply = post(f"{server.url}/admin/v1/rollback", {"model": "dlrm"})
        assert status == 200, reply
        assert {_keyed(server, dlrm, key) for key in keys[:5]} == {"2"}

        count = len(results)
        wait_for(lambda: len(results) > count + 5, "requests after the rollback", 60)
        with http_client(server) as http:
            http.unload_model("dlrm", query_params={"version": "1"})
            assert ("dlrm", "1") not in {
                k for k, s in repository_index(http).items() if s == "READY"
            }
            with pytest.raises(InferenceServerException):
                infer_version(http, dlrm, version="1")
        count = len(results)
        wait_for(lambda: len(results) > count + 5, "requests after the unload", 60)
    finally:
        finish()
    failed = [(status, reply) for _, _, status, reply, _ in results if status != 200]
    assert not failed, failed[:3]
    for _, _, _, reply, want in results:
        version = reply["model_version"]
        got = [np.asarray(o["data"], np.float64).reshape(o["shape"]) for o in reply["outputs"]]
        assert max_error(got, want[version]) <= TOLERANCE
    # dlrm 1's shard still holds tables the others use: it stays; its ranker stopped.
    assert "dlrm-1-shard-0" in _shard_tables(server)
    log = "\n".join(server.log)
    assert "dlrm-1-ranker-0" in log
    status, _ = get(_metrics_url(server, "dlrm-1-ranker-0"))
    assert status != 200


def _metrics_url(server, name: str) -> str:
    line = next(x for x in server.log if f" metrics {name} " in x)
    return line.split()[4]


def test_rollout_state_survives_a_router_restart(server, repo):
    root, dlrm, _, _ = repo
    _rollout(server, model="dlrm", version="3", percent=25)
    state = _get_json(f"{server.url}/admin/v1/rollout")
    assert state["models"]["dlrm"]["canary"] == {"version": "3", "percent": 25.0}
    assert json.loads((root / ROLLOUT_FILE).read_text())  # persisted in the repository
    argvs = processes_below(server.proc.pid)
    router = next(pid for pid, argv in argvs.items() if "cleave-router" in argv[0])
    os.kill(router, signal.SIGKILL)
    wait_for(lambda: _router_restarted(server, router), "the router to come back", 60)
    assert _get_json(f"{server.url}/admin/v1/rollout") == state
    # It serves what its predecessor did: version 3, loaded after the start, and not 1.
    with http_client(server) as http:
        ready = {key for key, state in repository_index(http).items() if state == "READY"}
        assert ready == {("dlrm", "2"), ("dlrm", "3"), ("dlrm-b", "1")}
        assert infer_version(http, dlrm, version="3")[0] == "3"
    # Malformed rollouts change nothing.
    for body in (
        {"model": "dlrm", "version": "3", "percent": 101},
        {"model": "dlrm", "version": "1", "percent": 5},  # unloaded
        {"model": "dlrm", "percent": 5},
        {"model": "nope", "version": "1", "percent": 5},
    ):
        status, reply = post(f"{server.url}/admin/v1/rollout", body)
        assert 400 <= status < 500, (body, reply)
    assert _get_json(f"{server.url}/admin/v1/rollout") == state


def _get_json(url: str) -> dict:
    status, text = get(url)
    assert status == 200, text
    return json.loads(text)


def _router_restarted(server, old: int) -> bool:
    argvs = processes_below(server.proc.pid)
    pids = [pid for pid, argv in argvs.items() if "cleave-router" in argv[0]]
    return bool(pids) and old not in pids and get(f"{server.url}/v2/health/ready")[0] == 200


def test_a_repository_plan_serves_on_the_local_runner(tmp_path):
    """`cleave serve --plan` of a repository plan without the testbed: every role here, on
    ports it picks (the plan's repeat across its hosts); tests/test_repository_testbed.py
    drives the same on emulated hosts."""
    from cleave.cli import main

    root = tmp_path / "repo"
    dlrm = Versions(root, "dlrm")
    dlrm.write(1)
    dlrm.write(2, dense=0.1, table="emb_l.0.weight")
    config = tmp_path / "serve.toml"
    config.write_text("[router]\nbudget_ms = 20000\nshed = false\n[ranker]\nthreads = 1\n")
    plan = tmp_path / "plan.yaml"
    flags = ["--hosts", "3", "--rankers", "1", "--config", str(config), "-o", str(plan)]
    assert main(["plan", str(root), *flags]) == 0
    with ServeProcess(None, "--plan", str(plan), "--runner", "local") as server:
        with http_client(server) as http:
            assert repository_index(http) == {("dlrm", "1"): "READY", ("dlrm", "2"): "READY"}
            for version, answered in (("1", "1"), ("2", "2"), ("", "2")):
                served, error = infer_version(http, dlrm, version=version)
                assert served == answered and error <= TOLERANCE
        assert server.stop() == 0
