"""Deployment plans (docs/plan.md): schema round trips, the planner's placement, validation
(each message names the field or host), the local default, and `cleave plan` as a command.

The plan code reads only manifest.json, so most tests use a manifest-only bundle; one test
plans a real partitioned bundle."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cleave.errors import UsageError
from cleave.plan import (
    Host,
    Plan,
    Ranker,
    dump_plan,
    emulated_hosts,
    load_cluster,
    load_plan,
    local_plan,
    make_plan,
    plan_to_dict,
    save_plan,
)
from cleave.plan.planner import table_ranges, whole_tables
from cleave.serve import Deployment
from cleave.settings import RankerConfig, RouterConfig, ServeConfig

TABLES = [  # 1000 x 64 B + 7 x 16 B + 50000 x 40 B: about 2 MB of rows
    {"name": "t0", "rows": 1000, "dim": 16, "dtype": "float32", "row_bytes": 64},
    {"name": "t1", "rows": 7, "dim": 8, "dtype": "float16", "row_bytes": 16},
    {"name": "t2", "rows": 50000, "dim": 32, "dtype": "int8_rowwise", "row_bytes": 40},
]
MANIFEST = {"format": "cleave-bundle", "version": 1, "tables": TABLES}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "model"
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps(MANIFEST))
    return path


def hosts(n: int, gpus: dict[int, int] | None = None) -> list[Host]:
    return [Host(f"h{i}", 8, 16.0, (gpus or {}).get(i, 0)) for i in range(n)]


def plan4(bundle: Path, **kw) -> Plan:
    """The testbed layout later benchmarks use: 4 hosts, 2 range groups x 2 replicas."""
    args = {"shards": 2, "replicas": 2, "rankers": 1, "routers": 1}
    args.update(kw)
    return make_plan(bundle, hosts(4), serve_config=ServeConfig(), **args)


def rows_held(shards) -> dict[str, set[int]]:
    held: dict[str, set[int]] = {t["name"]: set() for t in TABLES}
    for s in shards:
        for t, (a, b) in s.ranges.items():
            held[t].update(range(a, b))
    return held


def check_fails(plan: Plan, *fragments: str) -> str:
    with pytest.raises(UsageError) as err:
        plan.check(MANIFEST)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    return str(err.value)


# --- schema and files ------------------------------------------------------------------------


def test_round_trip(bundle, tmp_path):
    for plan in (plan4(bundle), local_plan(bundle, ServeConfig(shards=3, rankers=2))):
        path = save_plan(plan, tmp_path / "plan.yaml", header="made by a test")
        text = path.read_text()
        assert text.startswith("# Cleave deployment plan") and "# made by a test" in text
        assert "!!" not in text  # plain YAML a Helm template reads: no Python tags
        assert "t0: [0, 500]" in text or "t0: [0, 333]" in text  # ranges on one line
        loaded = load_plan(path)
        assert loaded == plan and loaded.source == path
        assert yaml.safe_load(text) == json.loads(json.dumps(plan_to_dict(plan)))
    assert not [p for p in tmp_path.iterdir() if p.name != "plan.yaml"]  # no temp file left


def test_router_section_follows_router_config(bundle):
    """Router keys come from RouterConfig's fields: a new key appears without plan edits."""
    plan = plan4(bundle)
    section = plan_to_dict(plan)["router"]
    assert list(section) == [f.name for f in dataclasses.fields(RouterConfig)]
    data = plan_to_dict(plan)
    data["router"] = {"budget_ms": 25.0}  # left-out keys take RouterConfig's defaults
    from cleave.plan import plan_from_dict

    loaded = plan_from_dict(data)
    assert loaded.router == dataclasses.replace(RouterConfig(), budget_ms=25.0)


def test_ranker_entries_cover_ranker_config():
    """A new `[ranker]` key must reach the plan, or the launcher could not pass it on."""
    plan_fields = {f.name for f in dataclasses.fields(Ranker)}
    assert {f.name for f in dataclasses.fields(RankerConfig)} <= plan_fields


def write_plan(tmp_path: Path, data, name: str = "plan.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def load_fails(tmp_path: Path, data, *fragments: str) -> str:
    path = write_plan(tmp_path, data)
    with pytest.raises(UsageError) as err:
        load_plan(path)
    message = str(err.value)
    assert message.startswith(str(path)), message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_malformed_files(bundle, tmp_path):
    good = plan_to_dict(plan4(bundle))

    def edit(change) -> dict:
        data = json.loads(json.dumps(good))
        change(data)
        return data

    load_fails(tmp_path, "hosts: [\n  - name: h0\n  cpus", "not valid YAML")
    load_fails(tmp_path, "- 1\n- 2\n", "expected a YAML mapping")
    load_fails(tmp_path, edit(lambda d: d.update(format="helm")), "format", "'cleave-plan'")
    load_fails(tmp_path, edit(lambda d: d.update(version=2)), "version", "got 2")
    load_fails(
        tmp_path,
        edit(lambda d: d["shards"][2].update(port="7000")),
        "shards[2].port: expected an integer, got str '7000'",
    )
    load_fails(
        tmp_path,
        edit(lambda d: d["shards"][1]["ranges"].update(t0=[1, 2, 3])),
        "shards[1].ranges.t0: expected a list of 2 items",
    )
    load_fails(
        tmp_path,
        edit(lambda d: d["hosts"][0].update(cpus=True)),
        "hosts[0].cpus: expected an integer, got bool True",
    )
    load_fails(
        tmp_path,
        edit(lambda d: d["rankers"][0].update(gpu_memory=3)),
        "rankers[0].gpu_memory: unknown key",
    )
    load_fails(tmp_path, edit(lambda d: d["router"].update(retries=3)), "router.retries: unknown")
    load_fails(tmp_path, edit(lambda d: d.update(extra=1)), "extra: unknown key")
    load_fails(tmp_path, edit(lambda d: d["routers"][0].pop("http_port")), "routers[0].http_port")
    load_fails(tmp_path, edit(lambda d: d.pop("transport")), "transport: missing")
    load_fails(tmp_path, edit(lambda d: d.update(shards={})), "shards: expected a list")


# --- the planner -----------------------------------------------------------------------------


def where(plan: Plan) -> dict[str, set[str]]:
    return {
        kind: {r.host for r in getattr(plan, kind)} for kind in ("shards", "rankers", "routers")
    }


def test_one_host_is_the_local_default(bundle):
    plan = make_plan(bundle, hosts(1), 3, 1, 2, 1, ServeConfig())
    assert where(plan) == {"shards": {"h0"}, "rankers": {"h0"}, "routers": {"h0"}}
    assert plan.transport == "shm"
    assert [s.ranges for s in plan.shards] == table_ranges(MANIFEST, 3)
    assert [s.name for s in plan.shards] == ["shard-0", "shard-1", "shard-2"]
    assert [r.threads for r in plan.rankers] == [3, 3]  # (8 cores - 1) // 2 rankers
    # cleave serve's thread rule leaves one core to 3 shards and a 2-thread router: it says so
    (warning,) = plan.check(MANIFEST)
    assert "host h0: its roles run 11 threads on 8 cpus" in warning


def test_table_layout_tables_holds_whole_tables_where_score_ranks_hold_them(tmp_path):
    # t0 is read by two features: the pooling work per sample, which the split balances first
    features = [{"name": f"f{i}", "table": t} for i, t in enumerate(["t0", "t0", "t1", "t2"])]
    manifest = {**MANIFEST, "features": features}
    path = tmp_path / "model"
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps(manifest))
    plan = make_plan(path, hosts(4), 2, 2, 1, 1, ServeConfig(table_layout="tables"))
    groups = {s.group: s.ranges for s in plan.shards}
    # largest first: t2 (2 MB) on 0, t0 on 1 (no lookups there yet), t1 on 0 (1 lookup < 2)
    assert groups == {0: {"t2": (0, 50000), "t1": (0, 7)}, 1: {"t0": (0, 1000)}}
    plan.check(manifest)
    local = local_plan(path, ServeConfig(shards=2, table_layout="tables"))
    assert [s.ranges for s in local.shards] == [groups[0], groups[1]]
    # cleave score's ranks hold the same tables: one split, computed in one place
    assert whole_tables(manifest, 2) == {"t2": 0, "t1": 0, "t0": 1}
    # more shards than tables: the empty ones are left out, as with rows
    assert len(table_ranges(manifest, 5, "tables")) == 5
    assert (
        len(make_plan(path, hosts(2), 5, 1, 1, 1, ServeConfig(table_layout="tables")).shards) == 3
    )
    with pytest.raises(UsageError, match='table_layout: expected "rows" or "tables", got'):
        ServeConfig(table_layout="columns").check()


def test_two_hosts(bundle):
    plan = make_plan(bundle, hosts(2), 2, 1, 1, 1, ServeConfig())
    assert where(plan) == {"shards": {"h1"}, "rankers": {"h0"}, "routers": {"h0"}}
    assert plan.transport == "tcp"
    assert [s.port for s in plan.shards] == [7000, 7001]
    plan.check(MANIFEST)


def test_four_hosts_testbed_layout(bundle):
    plan = plan4(bundle, rankers=2)
    assert where(plan) == {"shards": {"h1", "h2"}, "rankers": {"h3"}, "routers": {"h0"}}
    assert plan.transport == "tcp"
    assert [(s.name, s.group, s.host) for s in plan.shards] == [
        ("shard-0-0", 0, "h1"),
        ("shard-0-1", 0, "h2"),
        ("shard-1-0", 1, "h1"),
        ("shard-1-1", 1, "h2"),
    ]
    assert [(r.port, r.metrics_port, r.threads) for r in plan.rankers] == [
        (7100, 9100, 4),
        (7101, 9101, 4),
    ]  # a host of its own: all 8 cores for 2 rankers
    assert plan.routers[0].http_port == 8000
    plan.check(MANIFEST)


def test_cluster_file_with_a_gpu_host(bundle, tmp_path):
    cluster = {
        "hosts": [
            {"name": "cpu-a", "cpus": 16, "memory_gib": 64, "gpus": 0},
            {"name": "gpu-a", "cpus": 32, "memory_gib": 256, "gpus": 4, "labels": {"gpu": "h100"}},
            {"name": "cpu-b", "cpus": 16, "memory_gib": 64, "gpus": 0},
            {"name": "cpu-c", "cpus": 16, "memory_gib": 64, "gpus": 0},
        ]
    }
    path = write_plan(tmp_path, cluster, "cluster.yaml")
    machines = load_cluster(path)
    assert machines[1] == Host("gpu-a", 32, 256.0, 4, {"gpu": "h100"})
    config = ServeConfig()
    config.ranker.device = "cuda"
    plan = make_plan(bundle, machines, 4, 2, 2, 1, config)
    assert where(plan) == {"shards": {"cpu-b", "cpu-c"}, "rankers": {"gpu-a"}, "routers": {"cpu-a"}}
    plan.check(MANIFEST)
    twice = {"name": "cpu-a", "cpus": 1, "memory_gib": 1, "gpus": 0}
    path = write_plan(tmp_path, {"hosts": [*cluster["hosts"], twice]}, "cluster.yaml")
    with pytest.raises(UsageError, match=r"hosts\[4\].name: host 'cpu-a' is named twice"):
        load_cluster(path)
    path = write_plan(tmp_path, {"hosts": [{"name": "x", "cpus": 1, "memory_gib": 1}]}, "c.yaml")
    with pytest.raises(UsageError, match=r"c.yaml: hosts\[0\].gpus: missing"):
        load_cluster(path)


@pytest.mark.parametrize(("n", "shards", "k"), [(4, 2, 2), (5, 3, 2), (6, 5, 3), (7, 4, 2)])
def test_replicas_survive_losing_any_host(bundle, n, shards, k):
    plan = make_plan(bundle, hosts(n), shards, k, 1, 1, ServeConfig())
    plan.check(MANIFEST)
    groups: dict[int, list[str]] = {}
    for s in plan.shards:
        groups.setdefault(s.group, []).append(s.host)
    assert all(len(set(h)) == k == len(h) for h in groups.values())  # distinct hosts
    counts = [sum(s.host == h.name for s in plan.shards) for h in plan.hosts[1:-1]]
    assert max(counts) - min(counts) <= 1  # round-robin: even
    full = {t["name"]: set(range(t["rows"])) for t in TABLES}
    for lost in plan.hosts:
        assert rows_held(s for s in plan.shards if s.host != lost.name) == full, lost.name


def test_planner_refusals(bundle):
    with pytest.raises(UsageError, match=r"replicas: expected at most 2.*\(h1, h2\), got 3"):
        plan4(bundle, replicas=3)
    with pytest.raises(UsageError, match="replicas: expected at most 1"):
        make_plan(bundle, hosts(2), 2, 2, 1, 1, ServeConfig())
    with pytest.raises(UsageError, match="shards: expected at least 1, got 0"):
        plan4(bundle, shards=0)
    with pytest.raises(UsageError, match="monolithic"):
        make_plan(bundle, hosts(1), 1, 1, 1, 1, ServeConfig(monolithic=True))


def test_local_plan_is_todays_serve_layout(bundle, tmp_path):
    for config in (ServeConfig(shards=3, rankers=2), ServeConfig(shards=9, transport="tcp")):
        plan = local_plan(bundle, config)
        deployment = Deployment(bundle.resolve(), config, tmp_path)
        assert [s.ranges for s in plan.shards] == deployment.ranges  # 9 shards > 7 rows of t1
        assert [s.name for s in plan.shards] == [f"shard-{i}" for i in range(len(plan.shards))]
        assert [r.name for r in plan.rankers] == [f"ranker-{i}" for i in range(config.rankers)]
        assert all(r.threads == config.ranker_threads() for r in plan.rankers)
        assert [(h.name, r.host) for h in plan.hosts for r in plan.routers] == [("h0", "h0")]
        assert plan.transport == config.transport and plan.name == deployment.name
        assert {r.port for _, r in plan.roles() if hasattr(r, "port")} == {0}
        plan.check(MANIFEST)
    mono = local_plan(bundle, ServeConfig(monolithic=True))
    assert (mono.mode, mono.shards, len(mono.rankers)) == ("monolithic", [], 1)
    mono.check(MANIFEST)


def test_emulated_hosts():
    machines = emulated_hosts(3)
    assert [h.name for h in machines] == ["h0", "h1", "h2"]
    assert len({(h.cpus, h.memory_gib, h.gpus) for h in machines}) == 1
    with pytest.raises(UsageError, match="--hosts: expected 1..200"):
        emulated_hosts(0)


# --- validation ------------------------------------------------------------------------------


def test_coverage_errors(bundle):
    plan = plan4(bundle)
    for s in plan.shards[2:]:  # group 1 (rows 500.. of t0) gone: its rows are held by nobody
        s.ranges["t0"] = (500, 900)
    check_fails(plan, "coverage: table t0: rows [900, 1000) are held by no shard")

    plan = plan4(bundle)
    del plan.shards[2:]
    check_fails(plan, "table t0: rows [500, 1000)", "table t2: rows [25000, 50000)")

    plan = plan4(bundle)
    for s in plan.shards[2:]:
        s.ranges["t2"] = (24000, 50000)
    check_fails(plan, "shards[2].ranges.t2: rows [24000, 50000) overlap rows [0, 25000)")

    plan = plan4(bundle)
    plan.shards[3].ranges = {**plan.shards[3].ranges, "t1": (3, 6)}
    check_fails(plan, "shards[3].ranges: expected the ranges of shards[2] (shard-1-0)")


def test_range_errors(bundle):
    plan = plan4(bundle)
    plan.shards[0].ranges["t9"] = (0, 1)
    check_fails(plan, "shards[0].ranges.t9: expected a table of the bundle (t0, t1, t2)")
    plan = plan4(bundle)
    for s in plan.shards[2:]:
        s.ranges["t1"] = (3, 8)
    check_fails(plan, "shards[2].ranges.t1", "row_end <= 7", "got [3, 8]")
    plan = plan4(bundle)
    for s in plan.shards[:2]:
        s.ranges["t0"] = (0, 0)
    check_fails(plan, "shards[0].ranges.t0", "got [0, 0]")


def test_role_errors(bundle):
    plan = plan4(bundle)
    plan.rankers[0].host = "h9"
    check_fails(plan, "rankers[0].host: expected one of the plan's hosts (h0, h1, h2, h3)", "'h9'")

    plan = plan4(bundle)
    plan.shards[1].port = plan.shards[3].port
    check_fails(plan, "shards[3].port: port 7001 on host h2 is already shards[1].port")

    plan = plan4(bundle)
    plan.rankers[0].name = "shard-0-1"
    check_fails(plan, "rankers[0].name: 'shard-0-1' is already the name of shards[1]")

    plan = plan4(bundle)
    plan.router.budget_ms = -1.0
    check_fails(plan, "router.budget_ms: expected in (0, max_budget_ms]")

    plan = plan4(bundle)  # one dense dtype for every ranker: scores never depend on which
    plan.rankers.append(dataclasses.replace(plan.rankers[0], name="ranker-1", port=7101))
    plan.rankers[1].dense_dtype = "int8"
    check_fails(plan, "rankers[*].dense_dtype: expected one for every ranker, got auto, int8")
    plan.rankers[0].dense_dtype = "fp7"
    check_fails(plan, 'rankers[0].dense_dtype: expected "auto", "float32"', "'fp7'")


def test_resource_errors(bundle):
    plan = plan4(bundle)
    plan.hosts[2].memory_gib = 0.001
    check_fails(plan, "host h2: memory_gib: expected at least", "got 0.001")

    plan = plan4(bundle)
    plan.rankers[0].device = "cuda"
    check_fails(plan, "rankers[0].device: 'cuda' needs a GPU, but host h3 has gpus: 0")

    plan = plan4(bundle)
    plan.transport = "unix"
    check_fails(plan, "transport: 'unix' needs every role on one host, got roles on h0, h1, h2, h3")
    plan.transport = "shm"
    check_fails(plan, "transport: 'shm' needs every role on one host, got roles on h0, h1, h2, h3")

    plan = plan4(bundle)
    plan.hosts[1].cpus = 1  # two shards of 1 thread each
    (warning,) = plan.check(MANIFEST)
    assert "host h1: its roles run 2 threads on 1 cpus" in warning


def test_router_held_plans_have_no_shards_and_count_tables_on_router_hosts(bundle, tmp_path):
    config = ServeConfig(router_held=True)
    plan = make_plan(bundle, hosts(2), 3, 1, 1, 2, serve_config=config)
    assert (plan.mode, plan.shards, len(plan.routers)) == ("router-held", [], 2)
    plan.check(MANIFEST)  # no error (warnings about shared cores are fine)
    assert load_plan(save_plan(plan, tmp_path / "held.yaml")) == plan
    local = local_plan(bundle, ServeConfig(router_held=True, shards=3))
    assert (local.mode, local.shards) == ("router-held", [])

    router_host = plan.routers[0].host
    next(h for h in plan.hosts if h.name == router_host).memory_gib = 0.001
    check_fails(plan, f"host {router_host}: memory_gib", "router-held routers")

    held = make_plan(bundle, hosts(2), 1, 1, 1, 1, serve_config=config)
    held.shards = plan4(bundle).shards[:1]
    check_fails(held, "shards: expected none in mode 'router-held'")
    held.mode = "sideways"
    check_fails(held, 'mode: expected "disaggregated", "monolithic" or "router-held"')
    with pytest.raises(UsageError, match="router_held"):
        ServeConfig(router_held=True, monolithic=True).check()


def test_several_problems_are_reported_together(bundle):
    plan = plan4(bundle)
    plan.rankers[0].host, plan.routers[0].http_port = "nowhere", 70000
    message = check_fails(plan, "2 problems", "rankers[0].host", "routers[0].http_port")
    assert message.startswith("plan: ")


def test_real_bundle(tmp_path_factory):
    """A bundle cleave.partition wrote: its manifest plans and checks like the fixture's."""
    import cleave
    from cleave.bundle import manifest as manifest_io
    from cleave.models import MODELS

    model, example = MODELS["shared"].factory(scale=0.01, seed=0)
    path = cleave.partition(model, example).save(tmp_path_factory.mktemp("real") / "shared")
    plan = make_plan(path, hosts(4), 3, 2, 1, 1, ServeConfig())
    plan.check(manifest_io.read(path))
    assert dump_plan(plan).count("name: shard-") == 6


# --- the command -----------------------------------------------------------------------------


def cleave_plan(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cleave.cli", "plan", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_round_trip(bundle, tmp_path):
    out = tmp_path / "plans" / "p.yaml"
    out.parent.mkdir()
    args = [str(bundle), *"--hosts 4 --shards 2 --replicas 2 -o".split(), str(out)]
    done = cleave_plan(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "h0: router-0; h1: shard-0-0, shard-1-0" in done.stdout
    plan = load_plan(out)
    assert not Path(plan.bundle).is_absolute() and plan.bundle_path().resolve() == bundle
    assert f"# command: cleave plan {' '.join(args)}" in out.read_text()
    # Every shard its own directory for `cleave update`, beside the plan.
    assert [s.state_dir for s in plan.shards][:2] == ["state/shard-0-0", "state/shard-0-1"]
    checked = cleave_plan("--check", str(out), cwd=tmp_path)
    assert checked.returncode == 0 and f"{out}: OK" in checked.stdout, checked.stderr

    toml = tmp_path / "serve.toml"
    toml.write_text("[router]\nbudget_ms = 30.0\n[ranker]\nmax_batch = 64\n")
    done = cleave_plan(
        str(bundle), "--hosts", "1", "--config", str(toml), "-o", str(out), cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    plan = load_plan(out)
    assert (plan.router.budget_ms, plan.rankers[0].max_batch) == (30.0, 64)
    done = cleave_plan(str(bundle), "--hosts", "1", "--state-dir", "", "-o", str(out), cwd=tmp_path)
    assert done.returncode == 0 and load_plan(out).shards[0].state_dir == "", done.stderr


def test_cli_bad_input(bundle, tmp_path, tmp_path_factory):
    out = tmp_path / "p.yaml"
    small = {"hosts": [{"name": "tiny", "cpus": 1, "memory_gib": 0.001, "gpus": 0}]}
    cluster = write_plan(tmp_path_factory.mktemp("cluster"), small, "small.yaml")
    for args, fragment in [
        ([str(bundle), "--cluster", str(cluster)], "host tiny: memory_gib: expected at least"),
        ([str(bundle), "--hosts", "4", "--replicas", "3"], "replicas: expected at most 2"),
        ([str(bundle), "--hosts", "0"], "--hosts: expected 1..200"),
        ([str(tmp_path / "nothing"), "--hosts", "2"], "is not a directory"),
        ([str(bundle)], "expected --cluster CLUSTER.yaml or --hosts N"),
        ([str(bundle), "--cluster", str(tmp_path / "none.yaml")], "cluster file not found"),
    ]:
        done = cleave_plan(*args, "-o", str(out), cwd=tmp_path)
        assert done.returncode == 2, (args, done.stderr)
        assert fragment in done.stderr, done.stderr
        assert list(tmp_path.iterdir()) == [], "no partial file"
    done = cleave_plan(
        str(bundle), "--cluster", "c.yaml", "--hosts", "2", "-o", "p.yaml", cwd=tmp_path
    )
    assert done.returncode == 2 and "not allowed with argument" in done.stderr

    good = plan_to_dict(plan4(bundle))
    good["bundle"] = str(bundle)
    good["hosts"][3]["memory_gib"] = 0.001
    good["shards"][1]["host"] = "h3"
    good["rankers"][0]["device"] = "cuda"
    path = write_plan(tmp_path, good)
    done = cleave_plan("--check", str(path), cwd=tmp_path)
    assert done.returncode == 2
    assert "host h3: memory_gib" in done.stderr and "rankers[0].device" in done.stderr
