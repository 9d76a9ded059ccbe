"""The sizing model against the system (docs/sizing.md, "Validation"): a testbed host's CPU
cap is really applied (a busy loop there gets about its quota of CPU time) and removed with the
testbed, leftovers included; `cleave size --validate` serves a plan `cleave size` wrote from the
testbed catalog and returns the predicted and measured fields; plans it cannot validate and
catalog kinds the testbed cannot emulate are refused, naming why."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cleave.cli import main
from cleave.sizing.profile import measure
from cleave.testbed import commands, cpu
from cleave.testbed.testbed import Testbed
from support.cli import refused

pytestmark = [
    pytest.mark.testbed,
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
    pytest.mark.skipif(commands.unavailable() is not None, reason=commands.unavailable() or ""),
    pytest.mark.skipif(cpu.root() is None, reason="no cgroup cpu controller"),
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="caps need a core beside the client"),
]

CATALOG = Path(__file__).resolve().parents[1] / "deploy" / "catalogs" / "testbed.yaml"
BUSY = """
import os, sys, time
start = time.monotonic()
while time.monotonic() - start < float(sys.argv[1]):
    pass
t = os.times()
print(t.user + t.system, time.monotonic() - start, flush=True)
"""


def run(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(args)) == 0
    return out.getvalue()


def test_a_capped_host_gets_about_its_quota_and_its_cgroup_goes_with_it():
    cores = 0.2
    with Testbed(2, cpu_cores=[cores, None]) as tb:
        slot = tb.slot
        assert [p.name for p in cpu.groups(slot)] == [f"cleave-{slot}-h0"]
        done = tb.run(0, [sys.executable, "-c", BUSY, "1.5"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        used, wall = map(float, done.stdout.split())
        # A loose bound, not a timing: uncapped, the loop would use about all of `wall`.
        assert used < 2 * cores * wall, (used, wall)
        where = tb.run(0, ["cat", "/proc/self/cgroup"], capture_output=True, text=True).stdout
        assert f"/cleave-{slot}-h0" in where
        other = tb.run(1, ["cat", "/proc/self/cgroup"], capture_output=True, text=True).stdout
        assert "cleave-" not in other  # h1 is not capped
    assert cpu.groups(slot) == []


def test_a_leftover_cgroup_is_removed_by_the_next_testbed():
    version, base = cpu.root()
    leftover = base / cpu.group_name(509, 0)  # a slot nobody's state file records
    leftover.mkdir(exist_ok=True)
    try:
        with Testbed(1):
            assert not leftover.exists()
    finally:
        with contextlib.suppress(OSError):
            leftover.rmdir()


@pytest.fixture(scope="module")
def sized(models, tmp_path_factory) -> dict:
    """dlrm profiled quickly (no served run: the router is estimated) and sized from the
    testbed catalog at a low rate."""
    root = tmp_path_factory.mktemp("size-validate")
    bundle = models["dlrm"].dir
    profile = root / "profile.json"
    profile.write_text(json.dumps(measure(Path(bundle), 32, 1.0, 1.05, [1], True, serve=False)))
    plan = root / "plan.yaml"
    # One kind of 0.14 core: the 7 hosts of a minimal plan (2 routers, 3 shards, 2 rankers,
    # N+1) take 0.98 of a core, and the rankers, whose start (importing PyTorch, about 4 s of
    # CPU) is most of the test, start faster than on the shipped catalog's tenths.
    catalog = root / "catalog.yaml"
    kind = {"kind": "tb-test", "cpus": 1, "cpu_speed": 0.14, "memory_gib": 2, "nic_gbit": 0.5}
    catalog.write_text(
        yaml.safe_dump({"testbed": True, "machines": [{**kind, "price_per_hour": 1}]})
    )
    common = ["--profile", str(profile), "--p99-ms", "200"]
    run("size", str(bundle), "--rate", "10", "--catalog", str(catalog), "-o", str(plan), *common)
    return {
        "root": root,
        "bundle": str(bundle),
        "profile": profile,
        "plan": plan,
        "common": common,
        "catalog": catalog,
    }


def test_capped_hosts_are_measured_role_by_role(sized):
    """`cleave profile --capped`: the bundle served on hosts of the catalog's kind, each
    role's CPU per request measured at low load and saturated (so each role's processes are
    found: over TCP their arguments name no socket), as factors over the profile's."""
    from cleave.sizing.capped import measure_capped

    profile = json.loads(sized["profile"].read_text())
    got = measure_capped(Path(sized["bundle"]), profile, str(sized["catalog"]), True, print)
    capped = got["tb-test"]
    assert capped["cores"] == pytest.approx(0.14)
    # The smallest plan cleave size writes on the kind (7 x 0.14 cores fit beside the load
    # generator's core), at the target the plans are sized for.
    assert capped["hosts"] == {"routers": 2, "shards": 3, "rankers": 2}
    assert capped["p99_target_ms"] == 500 and capped["steps"]
    for load in ("low", "saturated"):
        for role in ("routers", "shards", "rankers"):
            assert capped[load]["cpu_ms"][role] > 0, (load, role, capped)
            assert capped[load]["factor"][role] > 0
    assert capped["saturated_rate"] > 0 and capped["low_p50_ms"] > 0


def test_validate_serves_the_plan_and_compares(sized):
    out = sized["root"] / "validated.json"
    argv = [sys.executable, "-m", "cleave.cli", "size", "--validate", str(sized["plan"])]
    done = subprocess.run(
        [*argv, "--quick", "--json", str(out)], capture_output=True, text=True, timeout=170
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    for key in (
        "predicted_max_rate",
        "measured_max_rate",
        "max_rate_ratio",
        "p99_target_ms",
        "p99_ms_at_sized_rate",
        "predicted_p99_ms",
        "meets_p99_at_sized_rate",
        "steps",
    ):
        assert key in got, key
    assert got["p99_target_ms"] == 200 and got["sized_rate"] == 10
    assert got["steps"][0]["at_sized_rate"] and got["steps"][0]["sent"] > 0
    plan = yaml.safe_load(sized["plan"].read_text())
    labels = [h["labels"] for h in plan["hosts"]]
    assert all(float(lb["cpu_cores"]) >= cpu.MIN_CORES and "link_gbit" in lb for lb in labels)


def test_plans_it_cannot_validate_are_refused(sized, tmp_path):
    # Not written by `cleave size`: no sizing line in its header.
    bare = tmp_path / "bare.yaml"
    text = sized["plan"].read_text()
    bare.write_text("\n".join(ln for ln in text.splitlines() if not ln.startswith("#")) + "\n")
    assert "not written by `cleave size`" in refused("size", "--validate", str(bare))
    assert "no such plan file" in refused("size", "--validate", str(tmp_path / "none.yaml"))
    # Sized from a catalog of real machines: its hosts are not the testbed's.
    example = CATALOG.parent / "example.yaml"
    real = tmp_path / "real.yaml"
    common = sized["common"]
    run(
        "size", sized["bundle"], "--rate", "10", "--catalog", str(example), "-o", str(real), *common
    )
    assert "testbed: true" in refused("size", "--validate", str(real))
    measured = ["profile", sized["bundle"], "-o", str(tmp_path / "p.json"), "--capped"]
    assert "not a testbed catalog" in refused(*measured, str(example))
    # Caps that leave the load generator no core.
    greedy = tmp_path / "greedy.yaml"
    greedy.write_text(text.replace("cpu_cores: '0.14'", "cpu_cores: '50'"))
    assert "keeps 1 for the load generator" in refused("size", "--validate", str(greedy))
    # Sizing needs its inputs unless it validates.
    assert "missing --rate" in refused("size", sized["bundle"], "--p99-ms", "5")


@pytest.mark.parametrize(
    "kind, expected",
    [
        ({"gpus": 1}, "the testbed has no GPUs"),
        ({"cpu_speed": 0.05}, "a testbed host's cap must be"),
        ({"cpu_speed": 1000.0}, "a testbed host's cap must be"),
        ({"nic_gbit": 400}, "htb shapes at most 100"),
    ],
)
def test_a_testbed_catalog_kind_it_cannot_emulate_is_refused(sized, tmp_path, kind, expected):
    machine = {"kind": "tb-x", "cpus": 1, "cpu_speed": 0.1, "memory_gib": 2, "nic_gbit": 0.2}
    catalog = tmp_path / "catalog.yaml"
    machine = {**machine, "price_per_hour": 0.01, **kind}
    catalog.write_text(yaml.safe_dump({"testbed": True, "machines": [machine]}))
    plan = tmp_path / "plan.yaml"
    err = refused(
        "size", sized["bundle"], "--rate", "10", "--catalog", str(catalog), "-o", str(plan),
        *sized["common"],
    )  # fmt: skip
    assert "cannot emulate" in err and "tb-x" in err and expected in err
    assert not plan.exists()
