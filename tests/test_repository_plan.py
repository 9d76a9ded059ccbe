"""Repository plans (docs/plan.md, "Repository plans"): `cleave plan REPO` writes every selected
version's roles, cut down to the tables it brings first; `cleave plan --check` validates each
version against its own bundle; a version loaded later is placed on the plan's hosts with the
plan's shape; the testbed's bindings keep ports unique per host across versions.

Manifest-only bundles (the plan code reads only manifest.json): version 2 of `ctr` changes
table t0, version 3 changes no table (in a real bundle: its dense weights only)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from cleave.cli import main
from cleave.errors import UsageError
from cleave.plan import emulated_hosts, load_plan, plan_from_dict, plan_to_dict, save_plan
from cleave.plan.repository import make_repository_plan, plan_shape, version_plan
from cleave.repository.placement import PlanPlacement, plan_config
from cleave.runners import testbed
from cleave.settings import RankerConfig, ServeConfig
from support.cli import refused

TABLES = [
    {"name": "t0", "rows": 1000, "dim": 16, "dtype": "float32", "row_bytes": 64},
    {"name": "t1", "rows": 300, "dim": 8, "dtype": "float16", "row_bytes": 16},
]


def write_version(repo: Path, model: str, version: int, changed: tuple[str, ...] = ()) -> Path:
    """REPO/MODEL/VERSION/manifest.json; a changed table has other bytes (another sha256)."""
    tables = [
        {**t, "file": f"tables/{t['name']}.bin", "sha256": f"{t['name']}-{t['name'] in changed}"}
        for t in TABLES
    ]
    bundle = repo / model / str(version)
    bundle.mkdir(parents=True)
    manifest = {"format": "cleave-bundle", "version": 1, "tables": tables}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    return bundle


@pytest.fixture
def repo(tmp_path) -> Path:
    root = tmp_path / "repo"
    write_version(root, "ctr", 1)
    write_version(root, "ctr", 2, changed=("t0",))
    write_version(root, "ctr", 3)
    return root


CONFIG = ServeConfig(ranker=RankerConfig(threads=1, device="cpu"))


def plan_of(repo: Path, **kw):
    args = {"hosts": emulated_hosts(4), "shards": 2, "replicas": 2, "rankers": 2, "routers": 1}
    args.update(kw)
    return make_repository_plan(repo, config=CONFIG, **args)


def test_each_version_gets_its_new_tables_and_every_role_names_its_version(repo):
    plan = plan_of(repo)
    by_version = {v: version_plan(plan, "ctr", v) for v in (1, 2, 3)}
    one, two, three = by_version[1], by_version[2], by_version[3]
    assert {t for s in one.shards for t in s.ranges} == {"t0", "t1"}
    assert {t for s in two.shards for t in s.ranges} == {"t0"}  # t1 is version 1's
    assert three.shards == []  # every table served already
    for v, mine in by_version.items():
        assert len(mine.rankers) == 2
        for role in [*mine.shards, *mine.rankers]:
            assert role.name.startswith(f"ctr-{v}-") and (role.model, role.version) == ("ctr", v)
    # Replicas 2 on distinct hosts; range groups numbered across the plan.
    assert len(one.shards) == 4 and len(two.shards) == 4
    assert not {s.group for s in one.shards} & {s.group for s in two.shards}
    # Logical ports unique per host across versions.
    taken = [(r.host, p) for r in [*plan.shards, *plan.rankers] for p in (r.port, r.metrics_port)]
    assert len(taken) == len(set(taken))
    assert plan.transport == "tcp" and len(plan.routers) == 1
    plan.validate()  # no error (warnings: 2-core emulated hosts run several roles each)
    assert plan_shape(plan) == (2, 2, 2)


def test_a_version_shares_each_table_with_the_version_that_brought_that_content(repo):
    write_version(repo, "ctr", 4, changed=("t0",))  # t0 as version 2's, t1 as version 1's
    plan = plan_of(repo)
    assert version_plan(plan, "ctr", 4).shards == []
    plan.validate()  # its t0 held by version 2's shards only, its t1 by version 1's


def test_a_repository_plan_round_trips_and_one_bundle_plans_load_without_the_fields(repo, tmp_path):
    plan = plan_of(repo)
    path = save_plan(plan, tmp_path / "plan.yaml")
    again = load_plan(path)
    assert again.shards == plan.shards and again.rankers == plan.rankers
    again.validate()
    # A plan file written before the fields existed: model "" and version 0.
    data = plan_to_dict(plan)
    for role in [*data["shards"], *data["rankers"]]:
        del role["model"], role["version"]
    old = plan_from_dict(data)
    assert {(s.model, s.version) for s in old.shards} == {("", 0)}


def test_cleave_plan_writes_and_checks_a_repository_plan(repo, tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    argv = ["plan", str(repo), "--hosts", "4", "--shards", "2", "--replicas", "2", "-o", str(out)]
    assert main([*argv, "--rankers", "2", "--config", str(_config(tmp_path))]) == 0
    assert "repository 'repo' (ctr/1, ctr/2, ctr/3)" in capsys.readouterr().out
    plan = load_plan(out)
    assert plan.bundle == "repo" and all(s.state_dir == "" for s in plan.shards)
    assert main(["plan", "--check", str(out)]) == 0
    assert ": OK: repository 'repo'" in capsys.readouterr().out
    # One router only: loads, unloads and rollout state live in it.
    err = refused(*argv[:-2], "--routers", "2", "-o", str(tmp_path / "two.yaml"))
    assert "routers: expected 1, got 2" in err and "rollout state" in err
    assert not (tmp_path / "two.yaml").exists()


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "serve.toml"
    path.write_text('[ranker]\nthreads = 1\ndevice = "cpu"\n')
    return path


def test_check_names_a_version_the_repository_does_not_have(repo):
    plan = plan_of(repo)
    plan.rankers[-1].version = 7
    with pytest.raises(UsageError) as err:
        plan.validate()
    message = str(err.value)
    assert "model 'ctr' version 7 (roles ctr-3-ranker-1): not in the repository" in message
    assert "ctr has versions [1, 2, 3]" in message


def test_check_finds_a_table_no_shard_holds_and_one_held_twice(repo):
    plan = plan_of(repo)
    # Version 2's shards gone: its own t0 is held by no shard.
    plan.shards = [s for s in plan.shards if s.version != 2]
    with pytest.raises(UsageError, match=r"model 'ctr' version 2: .*coverage: table t0"):
        plan.validate()
    plan = plan_of(repo)
    # Version 2's shards also hold t1, which version 1's hold (the same content key).
    i, shard = next((i, s) for i, s in enumerate(plan.shards) if s.version == 2)
    for s in plan.shards:
        if s.group == shard.group:
            s.ranges["t1"] = (0, 300)
    with pytest.raises(UsageError, match=rf"shards\[{i}\].ranges.t1: .* is held by ctr-1-shard"):
        plan.validate()
    plan = plan_of(repo)
    plan.rankers[0].model = ""
    with pytest.raises(UsageError, match=r"rankers\[0\]: expected the model and version"):
        plan.validate()


def test_a_version_loaded_later_is_placed_on_the_plans_hosts_with_its_shape(repo, tmp_path):
    plan = plan_of(repo, shards=1)
    plan.shards = [s for s in plan.shards if s.version == 1]
    plan.rankers = [r for r in plan.rankers if r.version == 1]  # version 1 carried only
    placement = PlanPlacement(plan, plan_config(plan, "127.0.0.1"))
    assert placement.roles("ctr", 1, repo / "ctr" / "1").shards == plan.shards
    later = placement.roles("ctr", 2, repo / "ctr" / "2")
    assert [s.name for s in later.shards] == ["ctr-2-shard-0-0", "ctr-2-shard-0-1"]
    assert len({s.host for s in later.shards}) == 2  # replicas on distinct hosts
    assert [r.name for r in later.rankers] == ["ctr-2-ranker-0", "ctr-2-ranker-1"]
    assert {r.host for r in later.shards + later.rankers} <= {h.name for h in plan.hosts}
    assert all(r.port == r.metrics_port == 0 for r in later.shards + later.rankers)
    assert later.rankers[0].threads == 1 and later.rankers[0].device == "cpu"


def test_testbed_ports_stay_unique_per_host_across_versions(repo):
    plan = plan_of(repo)
    ports = testbed.HostPorts()
    whole = testbed.TestbedBinding(plan, None, Path("."), ports)  # the router and carried roles
    one = testbed.TestbedBinding(version_plan(plan, "ctr", 1), None, Path("."), ports)
    # A version loaded later: its roles with port 0, on the same hosts.
    later = PlanPlacement(plan, plan_config(plan, "127.0.0.1")).roles("ctr", 4, repo / "ctr" / "2")
    later = dataclasses.replace(later, hosts=plan.hosts)
    four = testbed.TestbedBinding(later, None, Path("."), ports)
    held = list(ports.held.values())
    assert len(held) == len(set(held))  # every (host, port) once
    # A carried role keeps the port the whole plan's binding gave it.
    assert one.ports == {k: p for k, p in whole.ports.items() if k in one.ports}
    assert all(p >= 20000 for p in four.ports.values())  # picked: none of the plan's
    # Released roles give their ports back; a role asking again gets a fresh one.
    names = {r.name for r in [*later.shards, *later.rankers]}
    ports.free(names)
    assert not any(role in names for role, _ in ports.held)
    again = testbed.TestbedBinding(later, None, Path("."), ports)
    assert sorted(again.ports.values()) == sorted(four.ports.values())
    with pytest.raises(UsageError, match="is already ctr-1-shard-0-0's"):
        clash = dataclasses.replace(later.shards[0], name="other", host=plan.shards[0].host)
        clash.port = plan.shards[0].port
        testbed.TestbedBinding(
            dataclasses.replace(later, shards=[clash], rankers=[]), None, Path("."), ports
        )


def test_serving_a_plan_naming_a_missing_version_fails_naming_it(repo, tmp_path):
    plan = plan_of(repo)
    for role in [*plan.shards, *plan.rankers]:
        if role.version == 3:
            role.version = 7
    path = save_plan(plan, tmp_path / "plan.yaml")
    # Refused before anything is made: no testbed, no process.
    err = refused("serve", "--plan", str(path), "--runner", "testbed")
    assert "model 'ctr' version 7 (roles ctr-3-ranker-0, ctr-3-ranker-1): not in the" in err


def test_what_a_runner_cannot_serve_of_a_repository_is_refused(repo, tmp_path):
    # Ray runs a repository plan over TCP only (docs/ray.md): refused before it connects.
    plan = plan_of(repo)
    plan.transport = "mptcp"
    path = save_plan(plan, tmp_path / "plan.yaml")
    err = refused("serve", "--plan", str(path), "--runner", "ray")
    assert "the Ray runner runs plans over TCP; got transport 'mptcp'" in err
    # A repository without a plan runs on this machine only; the error says what to do.
    err = refused("serve", str(repo), "--runner", "testbed")
    assert "write a repository plan with `cleave plan REPO`" in err
