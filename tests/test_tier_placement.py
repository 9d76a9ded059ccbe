"""Placement across tiers and warm-up (docs/tiers.md): the greedy placement by bandwidth need
per byte keeps DRAM tables within the budget and never gives DRAM to a table that needs less
per byte than one it sends to SSD; bad access profiles are clear errors naming the file and
the field; `cleave plan --dram-budget --profile` records the choice; a real `cleave-shard`
honours it and warms its row cache from the profile's hottest rows before it reports ready."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import yaml
from cleave.errors import UsageError
from cleave.launch.supervisor import find_executable
from cleave.plan import load_plan
from cleave.plan.tiers import (
    CACHE_SHARE,
    MIN_CACHE_BYTES,
    AccessProfile,
    TableAccess,
    TableSize,
    check_profile,
    load_profile,
    need_per_byte,
    parse_bytes,
    parse_profile,
    place_tables,
)
from cleave.runners.roles import Binding, RoleSpecs
from hypothesis import given, settings
from hypothesis import strategies as st

MIB = 1 << 20


def profile_of(tables: dict[str, tuple[float, float]]) -> AccessProfile:
    return AccessProfile({n: TableAccess(q, p) for n, (q, p) in tables.items()}, "test")


def test_the_needy_small_table_stays_in_dram():
    sizes = {
        "users": TableSize(1_000_000, 256, 1_000_000),  # 256 MB, hit by every query
        "items": TableSize(40_000_000, 256, 40_000_000),  # 10 GB, same rate: 40x less per byte
        "rare": TableSize(10_000, 64, 10_000),  # tiny but never read
    }
    profile = profile_of({"users": (1000.0, 1.0), "items": (1000.0, 20.0)})
    placed = place_tables(1 << 30, sizes, profile)
    # "rare" would fit, but it needs less per byte than "items", which does not: SSD too.
    assert placed.dram == ["users"] and placed.ssd == ["items", "rare"]
    assert placed.dram_bytes + placed.cache_bytes == 1 << 30
    # Everything fits: nothing on SSD, no cache.
    placed = place_tables(20 << 30, sizes, profile)
    assert placed.ssd == [] and placed.cache_bytes == 0


sizes_st = st.dictionaries(
    st.sampled_from([f"t{i}" for i in range(8)]),
    st.tuples(
        st.integers(1, 200_000),  # rows
        st.sampled_from([16, 64, 256, 512]),  # row bytes
        st.floats(0, 1e5),  # queries/s
        st.floats(0.5, 100),  # pooling
    ),
    min_size=1,
)


@settings(max_examples=300, deadline=None)
@given(sizes_st, st.integers(MIB, 64 * MIB))
def test_placement_fits_the_budget_and_respects_need(tables, budget):
    sizes = {n: TableSize(r, b, r) for n, (r, b, _, _) in tables.items()}
    profile = profile_of({n: (q, p) for n, (_, _, q, p) in tables.items()})
    placed = place_tables(budget, sizes, profile)
    assert sorted(placed.dram + placed.ssd) == sorted(sizes)
    assert placed.dram_bytes == sum(sizes[n].bytes for n in placed.dram) <= budget
    if placed.ssd:
        reserve = max(MIN_CACHE_BYTES, int(budget * CACHE_SHARE))
        assert placed.dram_bytes <= budget - reserve
        assert placed.cache_bytes >= MIN_CACHE_BYTES
    need = {n: need_per_byte(profile.tables[n], sizes[n]) for n in sizes}
    for on_ssd in placed.ssd:
        for in_dram in placed.dram:
            assert need[in_dram] >= need[on_ssd], (in_dram, on_ssd, need)


def test_byte_counts_read_like_cleave_shards():
    assert parse_bytes("4M", "--dram-budget") == 4 * MIB
    assert parse_bytes("2g", "--dram-budget") == 2 << 30 and parse_bytes("512", "f") == 512
    with pytest.raises(UsageError, match=r"--dram-budget: expected bytes .* got 'lots'"):
        parse_bytes("lots", "--dram-budget")


def test_a_budget_below_the_cache_minimum_is_refused():
    with pytest.raises(UsageError, match=r"--dram-budget 1000: expected at least 1048576"):
        place_tables(1000, {"t": TableSize(100, 64, 100)}, None)


GOOD = {"format": "cleave-access-profile", "version": 1, "tables": {}}


@pytest.mark.parametrize(
    ("tables", "fragment"),
    [
        ({"t0": {"queries_per_s": -1, "pooling": 2}}, "tables.t0.queries_per_s: expected a number"),
        ({"t0": {"queries_per_s": "9", "pooling": 2}}, "tables.t0.queries_per_s: expected a num"),
        ({"t0": {"queries_per_s": 1, "pooling": 0}}, "tables.t0.pooling: expected a number > 0"),
        ({"t0": {"queries_per_s": 1}}, "tables.t0.pooling: missing"),
        ({"t0": {"queries_per_s": 1, "pooling": 1, "qps": 3}}, "tables.t0.qps: unknown key"),
        ({"t0": {"queries_per_s": 1, "pooling": 1, "hot_rows": [1, -2]}}, "tables.t0.hot_rows"),
        ({"t0": [1, 2]}, "tables.t0: expected an object"),
        ({}, "tables: expected a non-empty object"),
    ],
)
def test_bad_profiles_name_the_file_and_the_field(tmp_path, tables, fragment):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(GOOD | {"tables": tables}))
    with pytest.raises(UsageError) as err:
        load_profile(path)
    assert str(path) in str(err.value) and fragment in str(err.value), err.value


def test_profiles_that_are_not_json_or_not_profiles(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("tables: {}")
    with pytest.raises(UsageError, match=r"p.json: expected an access profile as JSON"):
        load_profile(path)
    path.write_text(json.dumps({"tables": {}}))
    with pytest.raises(UsageError, match=r"p.json: format: expected 'cleave-access-profile'"):
        load_profile(path)
    with pytest.raises(UsageError, match="not found"):
        load_profile(tmp_path / "missing.json")


def test_a_profile_must_match_the_bundle():
    manifest = {"tables": [{"name": "t0", "rows": 10, "row_bytes": 64}]}
    unknown = parse_profile(GOOD | {"tables": {"tx": {"queries_per_s": 1, "pooling": 1}}}, "p")
    with pytest.raises(UsageError, match=r"p: tables.tx: not a table of the bundle \(it has t0\)"):
        check_profile(unknown, manifest)
    entry = {"queries_per_s": 1, "pooling": 1, "hot_rows": [3, 10]}
    beyond = parse_profile(GOOD | {"tables": {"t0": entry}}, "p")
    with pytest.raises(UsageError, match=r"tables.t0.hot_rows: expected ids below .* got 10"):
        check_profile(beyond, manifest)


DIM = 64  # float32: 256-byte rows


def write_bundle(root: Path, tables: dict[str, int]) -> dict[str, np.ndarray]:
    """Float32 tables of DIM columns, `rows` each; returns their contents."""
    (root / "tables").mkdir(parents=True)
    metas, data = [], {}
    rng = np.random.default_rng(5)
    for name, rows in tables.items():
        data[name] = rng.random((rows, DIM), dtype=np.float32)
        raw = data[name].tobytes()
        (root / "tables" / f"{name}.bin").write_bytes(raw)
        metas.append(
            {"name": name, "file": f"tables/{name}.bin", "rows": rows, "dim": DIM}
            | {"dtype": "float32", "row_bytes": DIM * 4, "crc32": zlib.crc32(raw)}
        )
    manifest = {"format": "cleave-bundle", "version": 1, "producer": "test"}
    manifest |= {"inputs": [], "outputs": [], "tables": metas, "features": [], "boundary": []}
    (root / "manifest.json").write_text(json.dumps(manifest | {"shared_inputs": []}))
    return data


@pytest.fixture(scope="module")
def two_tables(tmp_path_factory) -> Path:
    # "small": 1 MiB read 50x more per byte; "big": 6 MiB. A 4 MiB budget holds only "small".
    root = tmp_path_factory.mktemp("place") / "bundle"
    write_bundle(root, {"small": 4096, "big": 6 * 4096})
    profile = {
        "small": {"queries_per_s": 5000, "pooling": 10},
        "big": {"queries_per_s": 500, "pooling": 20, "hot_rows": list(range(0, 6000, 3))},
    }
    (root.parent / "profile.json").write_text(json.dumps(GOOD | {"tables": profile}))
    return root


def cleave_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cleave.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cleave_plan_records_the_placement(two_tables, tmp_path):
    out = tmp_path / "plan.yaml"
    profile = two_tables.parent / "profile.json"
    layout = ["--hosts", "1", "--shards", "1", "-o", str(out)]
    proc = cleave_plan(str(two_tables), *layout, "--dram-budget", "4M", "--profile", str(profile))
    assert proc.returncode == 0, proc.stderr
    plan = load_plan(out)
    (shard,) = plan.shards
    assert shard.dram_budget == 4 * MIB and shard.ssd_tables == ["big"]
    assert (out.parent / shard.profile).resolve() == profile.resolve()
    assert "SSD ['big']" in out.read_text()  # the choice, explained in the header
    assert cleave_plan("--check", str(out)).returncode == 0
    # The local runner's command line carries the placement, and the shard it starts honours it.
    sock = f"unix:{tmp_path / 's.sock'}"

    class Local(Binding):
        def listen(self, role):
            return sock

        def metrics_port(self, role):
            return 0

    (spec,) = RoleSpecs(plan, Local(), tmp_path).shard_specs()
    argv = spec.argv
    assert argv[argv.index("--ssd-tables") + 1] == "big", argv
    assert Path(argv[argv.index("--profile") + 1]).resolve() == profile.resolve(), argv
    proc, line = start_shard(*argv[1:], log=tmp_path / "shard.log")
    try:
        assert line.startswith("ready"), (tmp_path / "shard.log").read_text()
    finally:
        stop(proc)
    assert "row cache warmed" in (tmp_path / "shard.log").read_text()
    # A plan naming a table its shard does not hold is refused by --check.
    data = yaml.safe_load(out.read_text())
    data["shards"][0]["ssd_tables"] = ["nope"]
    out.write_text(yaml.safe_dump(data))
    proc = cleave_plan("--check", str(out))
    assert proc.returncode != 0 and "shards[0].ssd_tables" in proc.stderr, proc.stderr
    proc = cleave_plan(str(two_tables), "--hosts", "1", "--profile", str(profile), "-o", str(out))
    assert proc.returncode != 0 and "--profile needs --dram-budget" in proc.stderr


def start_shard(*flags: str, log: Path) -> tuple[subprocess.Popen, str]:
    """A cleave-shard; returns it and its first stdout line ("ready ..." or "" if it exited)."""
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [find_executable("cleave-shard"), *flags],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    timer = threading.Timer(120, proc.kill)  # a shard that hangs cannot hang the test
    timer.start()
    try:
        line = proc.stdout.readline()
    finally:
        timer.cancel()
    return proc, line


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_shard_honours_the_placement_and_warms_before_ready(two_tables, tmp_path):
    listen = f"unix:{tmp_path / 's.sock'}"
    profile = two_tables.parent / "profile.json"
    log = tmp_path / "shard.log"
    flags = ["--bundle", str(two_tables), "--listen", listen, "--dram-budget", "4M"]
    proc, line = start_shard(
        *flags, "--ssd-tables", "big", "--profile", str(profile), "--log-format", "json", log=log
    )
    try:
        assert line.startswith("ready"), log.read_text()
    finally:
        stop(proc)
    events = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    ssd = [e["table"] for e in events if e.get("message") == "table on the SSD tier"]
    assert ssd == ["big"], "only the placed table is on SSD"
    messages = {e.get("message"): e for e in events}
    warmed = messages["row cache warmed"]
    assert '"big": 2000' in warmed["rows"], warmed  # every hot row fits the 3 MiB of caches


def test_shard_without_a_profile_starts_cold_and_says_so(two_tables, tmp_path):
    listen = f"unix:{tmp_path / 's.sock'}"
    log = tmp_path / "shard.log"
    flags = ["--bundle", str(two_tables), "--listen", listen, "--dram-budget", "4M"]
    proc, line = start_shard(*flags, "--ssd-tables", "big", log=log)
    try:
        assert line.startswith("ready"), log.read_text()
    finally:
        stop(proc)
    assert "no access profile (--profile): the row cache starts cold" in log.read_text()


def test_shard_placement_errors_are_clear(two_tables, tmp_path):
    listen = f"unix:{tmp_path / 's.sock'}"
    base = [find_executable("cleave-shard"), "--bundle", str(two_tables), "--listen", listen]

    def run(*flags):
        return subprocess.run([*base, *flags], capture_output=True, text=True, timeout=60)

    proc = run("--dram-budget", "4M", "--ssd-tables", "nope")
    assert proc.returncode == 2 and '"nope"' in proc.stderr and "manifest.json" in proc.stderr
    # "small" kept in DRAM (1 MiB) leaves 0.5 MiB of a 1.5 MiB budget for caches.
    proc = run("--dram-budget", str(3 * MIB // 2), "--ssd-tables", "big")
    assert proc.returncode == 2 and "leaving 524288 bytes" in proc.stderr, proc.stderr
    proc = run("--ssd-tables", "big")
    assert proc.returncode == 2 and "need --dram-budget" in proc.stderr, proc.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    proc = run("--dram-budget", "4M", "--ssd-tables", "big", "--profile", str(bad))
    assert proc.returncode == 2 and str(bad) in proc.stderr, proc.stderr
