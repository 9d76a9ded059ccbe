"""Topology-aware placement (docs/plan.md, "Topology-aware placement"): small topologies whose
best placement is known, limits, the Alibaba node list, topology errors, and `cleave plan`
with a topology as a command."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from cleave.errors import UsageError
from cleave.plan import Host, make_plan
from cleave.plan.cluster import load_cluster, load_cluster_file
from cleave.plan.placement import Request, place
from cleave.plan.topology import Node, build_topology, generated
from cleave.settings import ServeConfig

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
NODE_LIST = DATA / "alibaba-openb-node-list-2023.csv"
MANIFEST = {
    "format": "cleave-bundle",
    "version": 1,
    "tables": [{"name": "t0", "rows": 1000, "dim": 16, "dtype": "float32", "row_bytes": 64}],
}


def two_switches() -> tuple[list[Host], list[Node]]:
    """pod p0: switch a (cn0, hn0), switch b (cn1, cn2). hn0's first PCIe switch has GPUs but
    no NIC; its third has both: the known best home of a ranker."""
    hosts = [
        Host("cn0", 64, 256.0, 0),
        Host("hn0", 32, 256.0, 4),
        Host("cn1", 64, 256.0, 0),
        Host("cn2", 64, 256.0, 0),
    ]
    nodes = [
        Node("p0", "pod"),
        Node("a", "switch", "p0"),
        Node("b", "switch", "p0"),
        Node("cn0", "host", "a"),
        Node("hn0", "host", "a"),
        Node("cn1", "host", "b"),
        Node("cn2", "host", "b"),
        Node("hn0-n0", "numa", "hn0"),
        Node("hn0-n1", "numa", "hn0"),
        Node("hn0-x0", "pcie", "hn0-n0", gpus=2, nics=0, cpus=8),
        Node("hn0-x1", "pcie", "hn0-n0", gpus=0, nics=1, cpus=8),
        Node("hn0-x2", "pcie", "hn0-n1", gpus=2, nics=1, cpus=16),
    ]
    return hosts, nodes


def test_ranker_gpu_and_nic_under_one_pcie_switch():
    hosts, nodes = two_switches()
    topo = build_topology(nodes, hosts)
    p = place([Request("ranker-0", "rankers", 4, 1.0, 1)], topo)
    (c,) = p.choices
    assert (c.host, c.gpu_pcie, c.nic_pcie, c.score) == ("hn0", "hn0-x2", "hn0-x2", 2)
    assert c.cores == {"hn0-x2": 4}
    # Both GPUs of x2 taken: the next ranker gets x0, whose NIC is on its NUMA node (x1).
    p = place([Request(f"ranker-{i}", "rankers", 4, 1.0, 1) for i in range(3)], topo)
    got = [(c.gpu_pcie, c.nic_pcie, c.score) for c in p.choices]
    assert got == [("hn0-x2", "hn0-x2", 2)] * 2 + [("hn0-x0", "hn0-x1", 1)]


def test_router_cores_under_its_nic():
    hosts = [Host("cn0", 32, 64.0, 0)]
    nodes = [
        Node("p0", "pod"),
        Node("a", "switch", "p0"),
        Node("cn0", "host", "a"),
        Node("cn0-n0", "numa", "cn0"),
        Node("cn0-x0", "pcie", "cn0-n0", cpus=16),  # no NIC
        Node("cn0-x1", "pcie", "cn0-n0", nics=1, cpus=16),
    ]
    p = place([Request("router-0", "routers", 8, 0.5)], build_topology(nodes, hosts))
    (c,) = p.choices
    assert (c.cores, c.nic_pcie, c.score) == ({"cn0-x1": 8}, "cn0-x1", 2)
    # More cores than the NIC's switch has: the rest from its NUMA node, score 1.
    p = place([Request("router-0", "routers", 20, 0.5)], build_topology(nodes, hosts))
    assert (p.choices[0].cores, p.choices[0].score) == ({"cn0-x1": 16, "cn0-x0": 4}, 1)


def test_instances_pack_under_the_switch_holding_most():
    hosts, nodes = two_switches()
    reqs = [Request("ranker-0", "rankers", 4, 1.0, 1)]
    reqs += [Request(f"shard-{g}", "shards", 2, 10.0, 0, g) for g in range(3)]
    reqs += [Request("router-0", "routers", 2, 0.5)]
    p = place(reqs, build_topology(nodes, hosts))
    # The ranker must go to hn0 (switch a); everything else follows it there: cn0.
    assert {c.request.name: c.host for c in p.choices} == {
        "ranker-0": "hn0",
        "shard-0": "cn0",
        "shard-1": "cn0",
        "shard-2": "cn0",
        "router-0": "cn0",
    }
    assert p.cross_switch_pairs == 0 and p.pairs == 4


def test_replicas_spread_over_hosts_and_switches():
    hosts, nodes = two_switches()
    reqs = [Request(f"shard-{g}-{r}", "shards", 2, 10.0, 0, g) for g in range(2) for r in range(2)]
    p = place(reqs, build_topology(nodes, hosts))
    for g in range(2):
        pair = [c for c in p.choices if c.request.group == g]
        assert len({c.host for c in pair}) == 2
        assert len({c.switch for c in pair}) == 2  # two switches in the pod: one each


def test_a_roles_instances_spread_over_a_switchs_hosts():
    hosts = [Host("g0", 16, 64.0, 2), Host("g1", 16, 64.0, 2)]
    nodes = [Node("p0", "pod"), Node("s0", "switch", "p0")]
    nodes += [Node("g0", "host", "s0"), Node("g1", "host", "s0")]
    reqs = [Request(f"ranker-{i}", "rankers", 2, 1.0, 1) for i in range(4)]
    p = place(reqs, build_topology(nodes, hosts))
    assert [c.host for c in p.choices] == ["g0", "g1", "g0", "g1"]


def test_density_limit_and_whole_pod():
    hosts = [Host(f"h{i}", 16, 64.0, 2) for i in range(4)]
    # pod p0 has one host, p1 three: four rankers at most one per host fit only in p1.
    nodes = [Node("p0", "pod"), Node("p1", "pod"), Node("s0", "switch", "p0")]
    nodes += [Node("s1", "switch", "p1"), Node("h0", "host", "s0")]
    nodes += [Node(f"h{i}", "host", "s1") for i in (1, 2, 3)]
    topo = build_topology(nodes, hosts)
    reqs = [Request(f"ranker-{i}", "rankers", 2, 1.0, 1) for i in range(3)]
    p = place(reqs, topo, {"rankers": 1})
    assert sorted(c.host for c in p.choices) == ["h1", "h2", "h3"]
    assert {c.pod for c in p.choices} == {"p1"}
    with pytest.raises(UsageError, match=r"no pod holds every instance.*rankers 1"):
        place([*reqs, Request("ranker-3", "rankers", 2, 1.0, 1)], topo, {"rankers": 1})


def test_request_larger_than_every_host():
    hosts, nodes = two_switches()
    with pytest.raises(
        UsageError, match=r"shard-0: requests 2 cpus, 999.000 GiB.*larger than every"
    ):
        place([Request("shard-0", "shards", 2, 999.0, 0, 0)], build_topology(nodes, hosts))


def alibaba_hosts() -> list[Host]:
    with NODE_LIST.open() as f:
        rows = list(csv.DictReader(f))
    return [
        Host(r["sn"], int(r["cpu_milli"]) // 1000, int(r["memory_mib"]) / 1024, int(r["gpu"]))
        for r in rows
    ]


@pytest.mark.skipif(not NODE_LIST.exists(), reason="the shared data set is not on this machine")
def test_alibaba_node_list_places_everything_within_limits():
    hosts = alibaba_hosts()
    assert len(hosts) == 1523
    # 256 hosts a pod (8 switches of 32): a service as large as one pod can hold.
    topo = build_topology(generated(hosts), hosts)
    limits = {"rankers": 4, "shards": 2, "routers": 1}
    reqs = [Request(f"shard-{g}-{r}", "shards", 16, 200.0, 0, g) for g in range(40) for r in (0, 1)]
    reqs += [Request(f"ranker-{i}", "rankers", 8, 40.0, 1) for i in range(120)]
    reqs += [Request(f"router-{i}", "routers", 8, 16.0) for i in range(16)]
    p = place(reqs, topo, limits)
    assert len(p.choices) == len(reqs)
    assert len({c.pod for c in p.choices}) == 1
    by_host = {h.name: h for h in hosts}
    for name, host in by_host.items():
        mine = [c for c in p.choices if c.host == name]
        assert sum(c.request.cpus for c in mine) <= host.cpus
        assert sum(c.request.memory_gib for c in mine) <= host.memory_gib
        assert sum(c.request.gpus for c in mine) <= host.gpus
        for role, n in Counter(c.request.role for c in mine).items():
            assert n <= limits[role], (name, role)
    for g in range(40):
        assert len({c.host for c in p.choices if c.request.group == g}) == 2
    # every ranker's GPU shares its PCIe switch with a NIC (generated: one NIC per 2 GPUs)
    assert all(c.score == 2 for c in p.choices if c.request.role == "rankers")
    assert "cost:" in p.report[-1]


@pytest.mark.skipif(not NODE_LIST.exists(), reason="the shared data set is not on this machine")
def test_alibaba_node_list_plan(tmp_path):
    bundle = tmp_path / "model"
    bundle.mkdir()
    (bundle / "manifest.json").write_text(json.dumps(MANIFEST))
    hosts = alibaba_hosts()
    topo = build_topology(generated(hosts), hosts)
    plan = make_plan(bundle, hosts, 16, 2, 32, 4, ServeConfig(), topo, {"rankers": 2})
    plan.check(MANIFEST)  # raises on any broken rule
    gpus = {h.name: h.gpus for h in hosts}
    per_host = Counter(r.host for r in plan.rankers)
    assert len(plan.rankers) == 32 and all(gpus[h] >= n for h, n in per_host.items())
    assert max(per_host.values()) <= 2
    assert len(plan.shards) == 32 and len(plan.routers) == 4


def write(tmp_path: Path, data: dict, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def cluster_data() -> dict:
    hosts, nodes = two_switches()
    return {
        "hosts": [vars(h) for h in hosts],
        "topology": [{k: v for k, v in vars(n).items() if v} for n in nodes],
    }


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda d: d["topology"][3].update(parent="nowhere"),
            r"topology\[3\].parent: unknown node 'nowhere'",
        ),
        (
            lambda d: (d["topology"][1].update(parent="b"), d["topology"][2].update(parent="a")),
            r"topology\[1\].parent: the parents form a cycle: a -> b -> a",
        ),
        (
            lambda d: d["topology"][3].update(parent="p0"),
            r"topology\[3\].parent: a host belongs in a switch, but 'p0' is a pod",
        ),
        (
            lambda d: d["topology"][9].update(gpus=9),
            r"host hn0: its PCIe switches hold 11 GPUs.*gpus \(4\)",
        ),
        (lambda d: d["topology"].pop(6), r"hosts\[3\]: host 'cn2' is in no switch"),
        (
            lambda d: d["topology"][0].update(kind="rack"),
            r"topology\[0\].kind: expected one of pod",
        ),
        (
            lambda d: d.update(max_instance_per_node={"gpus": 1}),
            r"max_instance_per_node.gpus: expected shards",
        ),
    ],
)
def test_topology_errors_name_the_field(tmp_path, edit, message):
    data = cluster_data()
    edit(data)
    with pytest.raises(UsageError, match=message):
        load_cluster_file(write(tmp_path, data))


def test_cluster_without_topology_is_unchanged(tmp_path):
    data = cluster_data()
    del data["topology"]
    path = write(tmp_path, data)
    assert [h.name for h in load_cluster(path)] == ["cn0", "hn0", "cn1", "cn2"]
    assert load_cluster_file(path).topology is None


def test_make_plan_with_topology(tmp_path):
    bundle = tmp_path / "model"
    bundle.mkdir()
    (bundle / "manifest.json").write_text(json.dumps(MANIFEST))
    hosts, nodes = two_switches()
    topo = build_topology(nodes, hosts)
    plan = make_plan(bundle, hosts, 2, 2, 2, 1, ServeConfig(), topo, {"shards": 2})
    plan.check(MANIFEST)
    assert {r.host for r in plan.rankers} == {"hn0"}
    assert all(r.threads == 4 for r in plan.rankers)  # the cores it was given
    assert plan.placement[0].startswith("placement: pod p0")
    assert plan.placement[-1].startswith("cost: ")


def cleave(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cleave.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_plan_with_topology(tmp_path):
    bundle = tmp_path / "model"
    bundle.mkdir()
    (bundle / "manifest.json").write_text(json.dumps(MANIFEST))
    path = write(tmp_path, cluster_data())
    out = cleave(
        "plan",
        "model",
        "--cluster",
        path.name,
        "--shards",
        "2",
        "--replicas",
        "2",
        "-o",
        "plan.yaml",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "cleave plan: cost: " in out.stdout
    text = (tmp_path / "plan.yaml").read_text()
    assert "# ranker-0 -> hn0: switch a" in text and "under one PCIe switch" in text
    check = cleave("plan", "--check", "plan.yaml", cwd=tmp_path)
    assert check.returncode == 0, check.stderr
    data = cluster_data()
    data["topology"][4]["parent"] = "ghost"
    write(tmp_path, data, "bad.yaml")
    bad = cleave("plan", "model", "--cluster", "bad.yaml", "-o", "p2.yaml", cwd=tmp_path)
    assert bad.returncode == 2
    assert "topology[4].parent: unknown node 'ghost'" in bad.stderr
    assert not (tmp_path / "p2.yaml").exists()
    # A shard (rows + 64 MiB) larger than every host's memory: named, exit 2, no file.
    data = cluster_data()
    for h in data["hosts"]:
        h["memory_gib"] = 0.01
    write(tmp_path, data, "small.yaml")
    small = cleave("plan", "model", "--cluster", "small.yaml", "-o", "p3.yaml", cwd=tmp_path)
    assert small.returncode == 2
    assert "shard-0: requests 1 cpus, 0.063 GiB, 0 gpus: larger than every host" in small.stderr
    assert not (tmp_path / "p3.yaml").exists()
