"""`cleave simulate` (docs/simulate.md): the fragmentation metric on hand-computed hosts, the
replay on small synthetic traces (fragmentation, GPUs needed, loaning by hand), malformed
input, a slice of the shipped Alibaba trace, scaling signals, and the command's exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cleave.errors import UsageError
from cleave.simulate import replay as rp
from cleave.simulate.capacity import run_study
from cleave.simulate.fragmentation import fragments
from cleave.simulate.nodes import build_hosts, load_nodes
from cleave.simulate.report import to_json
from cleave.simulate.scaling import load_load, scaling_signals
from cleave.simulate.trace import load_trace

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TRACE = DATA / "alibaba-disaggregated-dlrm-trace-2025-first70pct.csv"
NODE_LIST = DATA / "alibaba-openb-node-list-2023.csv"
HEADER = (
    "instance_sn,role,app_name,cpu_request,cpu_limit,gpu_request,gpu_limit,rdma_request,"
    "rdma_limit,memory_request,memory_limit,disk_request,disk_limit,max_instance_per_node,"
    "creation_time,scheduled_time,deletion_time"
)


def row(name, role, app, cpu, gpu, mem, start="", end="", density=-1) -> str:
    requests = f"{cpu},{cpu},{gpu},{gpu},1,1,{mem},{mem},1,1,{density}"
    return f"{name},{role},{app},{requests},{start},{start},{end}"


def write_trace(tmp_path: Path, rows: list[str], name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text("\n".join([HEADER, *rows]) + "\n")
    return path


def write_nodes(tmp_path: Path, n: int = 2, cpu=16, mem_gib=64, gpus=2) -> Path:
    path = tmp_path / "nodes.csv"
    lines = ["sn,cpu_milli,memory_mib,gpu,model"]
    lines += [f"n{i},{cpu * 1000},{mem_gib * 1024},{gpus},X" for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_fragments_by_hand():
    # Types: A (8 cpus, no GPU) x1, B (2 cpus, 1 GPU) x3.
    types = np.array([[8.0, 10.0, 0.0], [2.0, 10.0, 1.0]])
    counts = np.array([1.0, 3.0])
    mem = np.array([100.0, 100.0])
    # h0: 4 free cpus, 2 GPUs: A misfits (1/4 of the workload) -> 4 * 1/4 = 1 CPU fragment.
    # h1: 16 cpus, no GPU: B misfits (3/4) -> 12. GPUs: only B counts; it fits h0 -> 0.
    # Weng et al.'s count: A needs no GPU, so h0's 2 GPUs are fragments for it: 2 * 1/4.
    got = fragments(np.array([4.0, 16.0]), mem, np.array([2.0, 0.0]), types, counts)
    assert got == (13.0, 0.0, 0.5)
    # h0 with 1 free cpu: both misfit (1 fragment CPU) and its 2 GPUs are stranded for B.
    got = fragments(np.array([1.0, 16.0]), mem, np.array([2.0, 0.0]), types, counts)
    assert got == (13.0, 2.0, 2.0)


def small_trace(tmp_path: Path) -> Path:
    # app a: two HNs (4 cpus, 1 GPU) and one CN (12 cpus), all alive over [0, 100).
    return write_trace(
        tmp_path,
        [
            row("i0", "HN", "a", 4, 1, 8, "", 100),
            row("i1", "CN", "a", 12, 0, 16, "", 100),
            row("i2", "HN", "a", 4, 1, 8, "", 100),
        ],
    )


def test_replay_by_hand(tmp_path):
    trace = load_trace(small_trace(tmp_path))
    types = load_nodes(write_nodes(tmp_path))
    mono = rp.monolithic(trace)
    # One instance per HN: 4 cpus + half the CN's 12, 8 GiB + half its 16.
    assert mono.cpu.tolist() == [10.0, 10.0] and mono.mem.tolist() == [16.0, 16.0]
    hosts = build_hosts(types, 1.0)
    d = rp.replay(rp.disaggregated(trace), hosts, samples=10)
    m = rp.replay(mono, hosts, samples=10)
    # Disaggregated: i0 and the CN fill host 0's cores, i2 goes to host 1; host 0's free GPU
    # cannot take an HN (no core left): 1 GPU fragment, no CPU fragment.
    assert d.cpu_fragments.tolist() == [0.0] * 10 and d.gpu_fragments.tolist() == [1.0] * 10
    # Monolithic: one 10-core instance per host; 6 cores and 1 GPU left on each, unusable.
    assert m.cpu_fragments.tolist() == [12.0] * 10 and m.gpu_fragments.tolist() == [2.0] * 10
    assert (d.failed, d.unplaceable, m.failed, m.unplaceable) == (0, 0, 0, 0)
    # GPUs needed: the two HNs share one 2-GPU host; the monolithic pair needs two hosts.
    assert rp.fewest_hosts(rp.gpu_holding(rp.disaggregated(trace)), types)[1].gpu.sum() == 2
    assert rp.fewest_hosts(rp.gpu_holding(mono), types)[1].gpu.sum() == 4


def test_study_json_by_hand(tmp_path):
    trace = load_trace(small_trace(tmp_path))
    types = load_nodes(write_nodes(tmp_path))
    doc = to_json(run_study(trace, types, 1.0, 50))
    assert doc["cpu_fragmentation"] == {"monolithic": 0.375, "disaggregated": 0.0}
    assert doc["gpu_fragmentation"] == {"monolithic": 0.5, "disaggregated": 0.25}
    assert doc["gpus_needed"] == {
        "monolithic": 4,
        "disaggregated": 2,
        "disaggregated_with_loaning": 2,
    }
    assert doc["unplaced"] == {"monolithic": 0.0, "disaggregated": 0.0}
    # Any mix: still 2-GPU hosts only here, so the same answer.
    assert doc["gpus_needed_any_mix"] == {"monolithic": 4, "disaggregated": 2, "instances": 2}


def test_zero_length_instances_hold_nothing(tmp_path):
    rows = [row("z", "HN", "a", 4, 1, 8, 5, 5), row("c", "CN", "a", 4, 0, 8, "", 10)]
    trace = load_trace(write_trace(tmp_path, rows))
    assert rp.monolithic(trace).cpu.tolist() == [8.0]  # finite: its own 4 + the CN's 4
    replay = rp.replay(rp.disaggregated(trace), build_hosts(load_nodes(write_nodes(tmp_path)), 1))
    assert (replay.instances, replay.failed, replay.unplaceable) == (1, 0, 0)


def test_loaning_by_hand(tmp_path):
    # Two HNs alive throughout, two more over [40, 50): 2 alive 90% of the time, 4 for 10%.
    rows = [row(f"i{i}", "HN", "a", 4, 1, 8, "", 100) for i in range(2)]
    rows += [row(f"p{i}", "HN", "a", 4, 1, 8, 40, 50) for i in range(2)]
    trace = load_trace(write_trace(tmp_path, rows))
    types = load_nodes(write_nodes(tmp_path))
    work = rp.gpu_holding(rp.disaggregated(trace))
    assert rp.percentile_alive(work, 50) == 2 and rp.percentile_alive(work, 95) == 4
    assert rp.split_for_loaning(work, 2).tolist() == [True, True, False, False]
    study = run_study(trace, types, 1.0, 50)
    assert study.gpus_needed["disaggregated"] == 4  # two 2-GPU hosts at the peak
    assert study.gpus_needed["disaggregated_with_loaning"] == 2
    assert study.loaning["borrowed_gpus"] == 8  # one training host (8 GPUs) for the peak
    assert study.loaning["borrowed_instances"] == 2


def test_too_large_instances_are_reported_in_every_mode(tmp_path):
    rows = [row("i0", "HN", "a", 4, 1, 8, "", 100), row("big", "CN", "b", 100, 0, 8, "", 100)]
    trace = load_trace(write_trace(tmp_path, rows))
    types = load_nodes(write_nodes(tmp_path))
    doc = to_json(run_study(trace, types, 1.0, 50))
    assert doc["instances"]["monolithic"]["unplaceable"] == 1
    assert doc["instances"]["disaggregated"]["unplaceable"] == 1
    assert doc["unplaced"] == {"monolithic": 0.5, "disaggregated": 0.5}


@pytest.mark.parametrize(
    "bad, message",
    [
        (row("x", "GPU", "a", 4, 1, 8), r"row 3: role: expected CN or HN, got 'GPU'"),
        (row("x", "HN", "a", "four", 1, 8), r"row 3: cpu_request: expected a number, got 'four'"),
        (row("x", "HN", "a", -4, 1, 8), r"row 3: cpu_request: expected >= 0"),
        (row("x", "HN", "a", 4, 1, 8, 50, 10), r"row 3: deletion_time: expected >= creation_time"),
        (row("x", "HN", "a", 4, 1, 8, density=0), r"row 3: max_instance_per_node: expected -1"),
        (row("x", "HN", "", 4, 1, 8), r"row 3: app_name: expected a name"),
        (row("x", "HN", "a", 4, 1, 8) + ",extra", r"row 3: expected 17 fields, got more"),
    ],
)
def test_malformed_trace_rows(tmp_path, bad, message):
    path = write_trace(tmp_path, [row("ok", "HN", "a", 4, 1, 8), bad])
    with pytest.raises(UsageError, match=message):
        load_trace(path)


def test_other_column_orders_and_names(tmp_path):
    # The same trace with its columns reversed and one more column; the node list with the
    # openb original's column names: the same study.
    path = small_trace(tmp_path)
    lines = [line.split(",") for line in path.read_text().splitlines()]
    other = tmp_path / "reordered.csv"
    other.write_text("\n".join(",".join([*reversed(x), "extra"]) for x in lines) + "\n")
    nodes = tmp_path / "openb.csv"
    nodes.write_text(
        "sn,cpu_milli,memory_mib,num_gpu,gpu_type\nn0,16000,65536,2,X\nn1,16000,65536,2,X\n"
    )
    a = to_json(run_study(load_trace(path), load_nodes(write_nodes(tmp_path)), 1.0, 50))
    b = to_json(run_study(load_trace(other), load_nodes(nodes), 1.0, 50))
    a.pop("cpu_seconds"), b.pop("cpu_seconds")
    assert a == b


def test_malformed_headers_and_node_lists(tmp_path):
    (tmp_path / "t.csv").write_text("instance_sn,role\nx,HN\n")
    with pytest.raises(UsageError, match=r"header: expected the columns .* missing app_name"):
        load_trace(tmp_path / "t.csv")
    with pytest.raises(UsageError, match=r"expected at least one instance row"):
        load_trace(write_trace(tmp_path, []))
    (tmp_path / "n.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,lots,1024,0,\n")
    with pytest.raises(UsageError, match=r"row 2: cpu_milli: expected a number, got 'lots'"):
        load_nodes(tmp_path / "n.csv")
    (tmp_path / "n.csv").write_text("sn,memory_mib\nn0,1024\n")
    with pytest.raises(UsageError, match=r"missing cpu_milli, gpu"):
        load_nodes(tmp_path / "n.csv")


def test_scaling_signals(tmp_path):
    path = tmp_path / "load.csv"
    path.write_text("time_s,requests_per_s\n0,100\n30,400\n60,50\n130,1000\n")
    windows = scaling_signals(load_load(path), 60, cn_rps=100, hn_rps=250, headroom=0.8)
    # peaks 400 (window 0), 50 (window 1), 1000 (window 2); CN = ceil(peak / 80), HN / 200.
    got = [(w.start_s, w.peak_rps, w.cn, w.hn) for w in windows]
    assert got == [(0, 400, 5, 2), (60, 50, 1, 1), (120, 1000, 13, 5)]
    path.write_text("time_s,requests_per_s\n10,100\n5,100\n")
    with pytest.raises(UsageError, match=r"row 3: time_s: expected times in increasing order"):
        load_load(path)
    path.write_text("time_s,requests_per_s\n10,-1\n")
    with pytest.raises(UsageError, match=r"row 2: requests_per_s: expected a number >= 0"):
        load_load(path)


@pytest.mark.skipif(not TRACE.exists(), reason="the shared data set is not on this machine")
def test_slice_of_the_alibaba_trace(tmp_path):
    lines = TRACE.read_text().splitlines()
    path = tmp_path / "slice.csv"
    path.write_text("\n".join(lines[:2001]) + "\n")  # the header and 2,000 instances
    trace = load_trace(path)
    assert len(trace) == 2000
    doc = to_json(run_study(trace, load_nodes(NODE_LIST), None, 50))
    for key in ("cpu_fragmentation", "gpu_fragmentation", "unplaced"):
        assert set(doc[key]) == {"monolithic", "disaggregated"}
    assert doc["cpu_fragmentation"]["disaggregated"] < doc["cpu_fragmentation"]["monolithic"]
    assert doc["gpu_fragmentation"]["disaggregated"] < doc["gpu_fragmentation"]["monolithic"]
    needed = doc["gpus_needed"]
    assert needed["disaggregated_with_loaning"] <= needed["disaggregated"]
    # every instance is counted: placed, failed or unplaceable, none dropped
    for mode, n in doc["instances"].items():
        assert n["total"] >= n["failed"] + n["unplaceable"], mode


def cleave(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cleave.cli", "simulate", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli(tmp_path):
    small_trace(tmp_path)
    write_nodes(tmp_path)
    out = cleave(
        "--trace",
        "trace.csv",
        "--nodes",
        "nodes.csv",
        "--cluster-scale",
        "1",
        "--json",
        "out.json",
        "--plot",
        "plots",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "gpus needed" in out.stdout
    doc = json.loads((tmp_path / "out.json").read_text())
    assert {"cpu_fragmentation", "gpu_fragmentation", "gpus_needed", "unplaced"} <= set(doc)
    assert set(doc["gpus_needed"]) == {"monolithic", "disaggregated", "disaggregated_with_loaning"}
    for name in ("fragmentation.png", "allocation.png", "unplaced.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"
    write_trace(tmp_path, [row("x", "HN", "a", "4x", 1, 8)], "bad.csv")
    bad = cleave("--trace", "bad.csv", "--nodes", "nodes.csv", cwd=tmp_path)
    assert bad.returncode == 2
    assert "bad.csv: row 2: cpu_request: expected a number, got '4x'" in bad.stderr
    assert cleave("--trace", "trace.csv", cwd=tmp_path).returncode == 2
    scale = cleave(
        "--trace", "trace.csv", "--nodes", "nodes.csv", "--cluster-scale", "big", cwd=tmp_path
    )
    assert scale.returncode == 2 and "--cluster-scale: expected auto" in scale.stderr
    (tmp_path / "load.csv").write_text("time_s,requests_per_s\n0,100\n")
    sig = cleave(
        "--load", "load.csv", "--cn-rps", "10", "--hn-rps", "50", "--json", "s.json", cwd=tmp_path
    )
    assert sig.returncode == 0, sig.stderr
    assert json.loads((tmp_path / "s.json").read_text())["windows"][0]["cn"] == 13
    assert cleave("--load", "load.csv", cwd=tmp_path).returncode == 2


def test_cpu_only_trace_and_cluster(tmp_path):
    trace = load_trace(write_trace(tmp_path, [row("c0", "CN", "a", 4, 0, 8, "", 10)]))
    types = load_nodes(write_nodes(tmp_path, gpus=0))
    doc = to_json(run_study(trace, types, None, 50))
    assert doc["gpus_needed"] == {
        "monolithic": 0,
        "disaggregated": 0,
        "disaggregated_with_loaning": 0,
    }
    assert doc["gpu_fragmentation"] == {"monolithic": 0.0, "disaggregated": 0.0}
    assert doc["loaning"]["borrowed_gpus"] == 0
    with pytest.raises(UsageError, match=r"--loan-percentile: expected 0 < P <= 100, got 0"):
        run_study(trace, types, None, 0)
