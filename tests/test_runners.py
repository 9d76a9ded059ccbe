"""Runners (docs/plan.md, "Runners"): a 4-host plan of the `shared` model served by
`cleave serve --plan` on the emulated testbed and as local processes, scored over HTTP against
the original model; SIGTERM stops every role (and removes the testbed); --url-file; bad input
exits 2 leaving nothing behind. Kept small: one deployment per runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cleave.launch.process import ServeProcess
from cleave.plan import emulated_hosts, make_plan, save_plan
from cleave.settings import RankerConfig, ServeConfig
from cleave.testbed import commands
from support.processes import descendants, namespaces_of_testbeds, parent_of, processes_below
from support.served import Served, check_scores, run_serve

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    return Served("shared", tmp_path_factory.mktemp("runners"))


@pytest.fixture(scope="module")
def plan_file(served, tmp_path_factory) -> Path:
    # One ranker thread: the machine is shared, and every emulated host claims all its cores.
    config = ServeConfig(ranker=RankerConfig(threads=1, device="cpu"))
    plan = make_plan(
        served.dir,
        emulated_hosts(4),
        shards=2,
        replicas=1,
        rankers=1,
        routers=1,
        serve_config=config,
    )
    path = tmp_path_factory.mktemp("plan") / "shared.yaml"
    save_plan(plan, path)
    return path


def serve_plan(*flags: str) -> ServeProcess:
    return ServeProcess(None, *flags)  # the bundle comes from the plan


@pytest.mark.testbed
@pytest.mark.skipif(commands.unavailable() is not None, reason=commands.unavailable() or "")
def test_testbed_runner_serves_the_plan_and_removes_the_testbed(served, plan_file, tmp_path):
    before = namespaces_of_testbeds()
    urls = tmp_path / "urls.txt"
    server = serve_plan("--plan", str(plan_file), "--runner", "testbed", "--url-file", str(urls))
    with server:
        # The router binds its emulated host's address and the plan's port, 8000.
        assert server.url.startswith("http://198.1") and server.url.endswith(":8000")
        assert urls.read_text() == f"{server.url}\n"
        made = namespaces_of_testbeds() - before
        assert len(made) == 4, made
        check_scores(server, served)
        roles = descendants(server.proc.pid)
        assert len(roles) >= 4  # two shards, a ranker and a router
        # The ranker was forked by a fork server in its host's namespace, its parent.
        below = processes_below(server.proc.pid)
        (ranker,) = [pid for pid, argv in below.items() if "ranker" in argv]
        assert "cleave.launch.forkserver" in below[parent_of(ranker)]
        assert os.readlink(f"/proc/{ranker}/ns/net") != os.readlink("/proc/self/ns/net")
        assert server.stop() == 0
    assert not urls.exists()  # removed with the deployment: its URLs are dead
    assert namespaces_of_testbeds() - before == set()
    assert not [pid for pid in roles if Path(f"/proc/{pid}").exists()]


def test_local_runner_serves_the_same_plan_over_tcp_through_two_routers(served, tmp_path):
    # The 4-host layout with a second router (Prism's several frontends): both front the same
    # shards and rankers.
    config = ServeConfig(ranker=RankerConfig(threads=1, device="cpu"))
    plan = make_plan(served.dir, emulated_hosts(4), 2, 1, 1, 2, serve_config=config)
    plan_file = save_plan(plan, tmp_path / "two-routers.yaml")
    urls = tmp_path / "urls.txt"
    # Port 0: the plan's ports may be taken on this machine, and its shard ports clash on one
    # machine (7000 on h1 and h2), so the local runner picks free ones.
    flags = ("--plan", str(plan_file), "--http-port", "0", "--url-file", str(urls))
    with serve_plan(*flags) as server:
        first, second = urls.read_text().splitlines()
        assert server.url == first and first != second and second.startswith("http://127.0.0.1:")
        check_scores(server, served)
        server.url = second
        check_scores(server, served)
        roles = descendants(server.proc.pid)
        assert len(roles) == 6  # two shards, a ranker and its fork server, two routers
        assert server.stop() == 0
    assert not [pid for pid in roles if Path(f"/proc/{pid}").exists()]


@pytest.mark.testbed  # counts the machine's testbed namespaces
def test_bad_input_exits_2_leaving_nothing(served, plan_file, tmp_path):
    before = namespaces_of_testbeds()
    result = run_serve("--plan", str(tmp_path / "missing.yaml"))
    assert result.returncode == 2 and "missing.yaml: plan not found" in result.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("format: cleave-plan\nversion: [\n")
    result = run_serve("--plan", str(bad))
    assert result.returncode == 2 and "not valid YAML" in result.stderr
    result = run_serve("--plan", str(plan_file), "--runner", "nomad")
    assert result.returncode == 2 and "invalid choice: 'nomad'" in result.stderr
    result = run_serve(str(served.dir), "--plan", str(plan_file))
    assert result.returncode == 2 and "exactly one of BUNDLE or --plan" in result.stderr
    result = run_serve()
    assert result.returncode == 2 and "got neither" in result.stderr
    result = run_serve("--plan", str(plan_file), "--shards", "3")
    assert result.returncode == 2 and "--shards: not with --plan" in result.stderr
    result = run_serve("--plan", str(plan_file), "--url-file", str(tmp_path / "no" / "urls"))
    assert result.returncode == 2 and "does not exist" in result.stderr
    result = run_serve("--plan", str(plan_file), "--link-gbit", "2")
    assert result.returncode == 2 and "--link-gbit: only with --runner testbed" in result.stderr
    assert namespaces_of_testbeds() == before
    assert not list(tmp_path.glob("**/urls*"))


def test_testbed_without_cap_net_admin_is_a_clear_error(plan_file):
    if commands.has_net_admin():  # drop the capability for the child: capsh is in libcap2-bin
        capsh = subprocess.run(["which", "capsh"], capture_output=True, text=True).stdout.strip()
        if not capsh:
            pytest.skip("holds CAP_NET_ADMIN and has no capsh to drop it")
        argv = [capsh, "--drop=cap_net_admin", "--", "-c", 'exec "$@"', "--"]
    else:
        argv = []
    argv += [sys.executable, "-m", "cleave.cli", "serve", "--plan", str(plan_file)]
    result = subprocess.run(
        [*argv, "--runner", "testbed"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert "needs CAP_NET_ADMIN" in result.stderr


def test_router_gets_every_replica_of_every_range_group(served, tmp_path):
    """No processes: the specs of a plan with two replicas per group, on the testbed layout."""
    from cleave.runners.roles import Binding, RoleSpecs

    class Fake(Binding):
        def listen(self, role):
            return f"{role.host}:{role.port}"

        def http(self, router):
            return router.host, router.http_port

        def wrap(self, role, argv):
            return ["in", role.host, *argv]

    config = ServeConfig(ranker=RankerConfig(threads=1))
    plan = make_plan(served.dir, emulated_hosts(4), 2, 2, 1, 1, serve_config=config)
    specs = RoleSpecs(plan, Fake(), tmp_path)
    shards, rankers = specs.shard_specs(), specs.ranker_specs()
    assert [s.name for s in shards] == ["shard-0-0", "shard-0-1", "shard-1-0", "shard-1-1"]
    assert shards[1].argv[:2] == ["in", "h2"] and "h2:7000" in shards[1].argv
    (router,) = specs.router_specs(shards, rankers)
    config = json.loads(specs.config_path("router-0").read_text())
    # Every replica of every group is a route: the router fails over between replicas.
    assert {r["addr"] for r in config["shards"]} == {"h1:7000", "h1:7001", "h2:7000", "h2:7001"}
    assert config["rankers"] == ["h3:7100"] and config["host"] == "h0"
    assert router.argv[:2] == ["in", "h0"]


def test_ports_picked_for_roles_are_ones_the_kernel_never_hands_out_by_itself(tmp_path):
    """The race a clean clone's CI hit: a port picked from the kernel's ephemeral range was
    taken by one of a Ray deployment's own outgoing connections before the router bound it.
    Picked ports lie outside that range, are distinct, and are free."""
    import socket

    from cleave.runners.local import EPHEMERAL, free_ports, quiet_candidates

    low, high = map(int, EPHEMERAL.read_text().split())
    ports = free_ports("127.0.0.1", 40)
    assert len(set(ports)) == 40
    assert [p for p in ports if low <= p <= high] == []
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free: nothing kept it
    narrow = tmp_path / "range"
    narrow.write_text("20000\t65000\n")
    assert quiet_candidates(narrow) == list(range(65001, 65536))
    narrow.write_text("not a range")  # unreadable: Linux's default range is assumed
    assert 32768 not in quiet_candidates(narrow) and 32767 in quiet_candidates(narrow)
