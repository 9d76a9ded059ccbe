"""`cleave update` against real `cleave shard` processes (docs/tiers.md, "Updates"): after an
update, lookups equal a shard on a freshly written table with the new rows, bit for bit (DRAM
and SSD tier, every dtype, sum and mean, per-sample weights); during one, every response is
the old or the new version's whole; a restarted shard serves the committed version and drops
a staged one; bad input is refused naming the file, value or shard, and leaves the old
version serving with nothing left in the state directory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from cleave import _native
from cleave.plan.files import load_plan, save_plan
from cleave.plan.schema import Host, Plan, Supervision
from cleave.settings import RouterConfig
from cleave.update import _Shard, apply_update, write_delta
from support.shards import ROWS as SHARD_ROWS
from support.shards import Shard
from support.shards import write_bundle as write_shard_bundle

ROWS = {**SHARD_ROWS, "i4": 101}  # every dtype the engine has
SSD = ("--dram-budget", "1M", "--ssd-tables", ",".join(ROWS))
UPDATED = ["f32", "f16", "i8", "i4"]  # "wide" stays at version 0


def write_bundle(root: Path, seed: int) -> None:
    """test_shard's bundle plus an int4_rowwise table (dim 10: 5 bytes of nibbles, scale, bias)."""
    write_shard_bundle(root, seed=seed)
    rng = np.random.default_rng(seed + 100)
    rows, dim = ROWS["i4"], 10
    q = rng.integers(0, 256, size=(rows, 5), dtype=np.uint8)
    scale_bias = (rng.standard_normal((rows, 2)) * 0.1).astype("<f4").view(np.uint8)
    data = np.concatenate([q, scale_bias], axis=1).tobytes()
    (root / "tables" / "i4.bin").write_bytes(data)
    m = json.loads((root / "manifest.json").read_text())
    m["tables"].append(
        {"name": "i4", "file": "tables/i4.bin", "rows": rows, "dim": dim,
         "dtype": "int4_rowwise", "row_bytes": 13, "crc32": zlib.crc32(data)}
    )  # fmt: skip
    (root / "manifest.json").write_text(json.dumps(m))


def manifest(bundle: Path) -> dict:
    return {t["name"]: t for t in json.loads((bundle / "manifest.json").read_text())["tables"]}


def stored(bundle: Path, name: str) -> np.ndarray:
    t = manifest(bundle)[name]
    data = np.fromfile(bundle / t["file"], dtype=np.uint8)
    return data.reshape(t["rows"], t["row_bytes"])


def requests(rng, tables=tuple(ROWS)) -> list:
    out = []
    for name in tables:
        for pooling in ("sum", "mean"):
            lengths = rng.integers(0, 6, size=16)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            ids = rng.integers(0, ROWS[name], size=int(offsets[-1])).astype(np.int64)
            ids[::4] = rng.integers(0, 4, size=len(ids[::4]))  # the updated ids, often
            out.append((name, pooling, ids, offsets))
        weights = rng.standard_normal(len(ids)).astype(np.float32)  # sum pooling only
        out.append((name, "sum", ids, offsets, weights))
    return out


def answers(address: str, reqs) -> list[bytes]:
    client = _native.ShardClient([(t, 0, r, address) for t, r in ROWS.items()], timeout_s=10)
    return [o.tobytes() for o in client.lookup(reqs)]


def version(shard: Shard, table: str) -> float:
    return shard.metric(f'cleave_shard_table_version{{table="{table}"}}')


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """(old bundle, new rows' source bundle, the old one with the deltas applied, deltas)."""
    root = tmp_path_factory.mktemp("update")
    old, source, fresh = root / "old", root / "source", root / "fresh"
    write_bundle(old, seed=0)
    write_bundle(source, seed=1)
    shutil.copytree(old, fresh)
    deltas = {}
    for name in UPDATED:
        ids = np.array([0, 3, ROWS[name] - 1, 3])  # 3 twice: the later row wins
        new = stored(source, name)[[0, 1, 2, 3]]
        deltas[name] = write_delta(root / f"{name}.delta", manifest(old)[name], ids, new)
        rows = stored(fresh, name).copy()
        rows[ids[:3]] = new[[0, 3, 2]]
        rows.tofile(fresh / manifest(fresh)[name]["file"])
    return old, source, fresh, deltas


@pytest.mark.parametrize("store", ["dram", "ssd"])
def test_updates_equal_a_fresh_table_bit_for_bit_and_survive_restarts(bundles, tmp_path, store):
    old, source, fresh, deltas = bundles
    flags = SSD if store == "ssd" else ()
    state = tmp_path / "state"
    shard = Shard(old, "--state-dir", str(state), *flags).wait_ready()
    ref = Shard(fresh, *flags).wait_ready()
    reqs = requests(np.random.default_rng(1))
    try:
        before = answers(shard.address, reqs)
        for name in UPDATED:
            got = apply_update([shard.address], name, deltas[name], "rows")
            assert got == {shard.address: 1}
        want = answers(ref.address, reqs)
        assert want != before  # else the check below could not fail
        assert answers(shard.address, reqs) == want
        assert [version(shard, t) for t in ("f32", "i4", "wide")] == [1, 1, 0]
        assert shard.metric('cleave_shard_update_steps_total{outcome="error"}') == 0
        shard.stop()
        shard = Shard(old, "--state-dir", str(state), *flags).wait_ready()
        assert answers(shard.address, reqs) == want  # the committed version, from state/
        assert version(shard, "f16") == 1
        # A whole new file: version 2, equal to a shard on that file.
        f32 = old.parent / "source" / manifest(source)["f32"]["file"]
        apply_update([shard.address], "f32", f32, "file")
        assert version(shard, "f32") == 2
        ref.stop()
        ref = Shard(source, *flags).wait_ready()
        only = [r for r in reqs if r[0] == "f32"]
        assert answers(shard.address, only) == answers(ref.address, only)
        assert sorted(p.name for p in state.iterdir()) == [
            ".lock",
            "f16.v1.tbl",
            "f32.v2.tbl",
            "i4.v1.tbl",
            "i8.v1.tbl",
            "state.json",
        ]  # the replaced f32.v1.tbl deleted
    finally:
        shard.stop()
        ref.stop()


def test_lookups_during_an_update_see_one_version_whole(bundles, tmp_path):
    old, _, fresh, deltas = bundles
    shard = Shard(old, "--state-dir", str(tmp_path / "state")).wait_ready()
    ref = Shard(fresh, "--threads", "1").wait_ready()
    # Two lookups of the updated table in one request: a mix would differ from both.
    reqs = requests(np.random.default_rng(2), tables=("f32",))
    versions = [answers(shard.address, reqs), answers(ref.address, reqs)]
    assert versions[0] != versions[1]
    # The versions seen in order (an answer is kept when it differs from the one before) and
    # how many lookups were answered in all.
    seen, answered, stop = [], [0], threading.Event()

    def look():
        # Until stopped: staging under load can take many seconds, and the lookups must go on
        # until after the switch. The deadline only bounds a hung shard.
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            answer = answers(shard.address, reqs)
            if not seen or answer != seen[-1]:
                seen.append(answer)
            answered[0] += 1

    thread = threading.Thread(target=look)
    thread.start()
    try:
        while answered[0] < 3 and thread.is_alive():
            time.sleep(0.01)
        apply_update([shard.address], "f32", deltas["f32"], "rows")
        after = answered[0]
        while answered[0] < after + 3 and thread.is_alive():
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join()
        ref.stop()
        shard.stop()
    assert [s for s in seen if s not in versions] == [], "a lookup saw a mix of versions"
    assert seen == versions, "expected the old version, then the new one, and no going back"


def test_a_staged_update_never_switched_is_dropped_on_restart(bundles, tmp_path):
    old, _, _, deltas = bundles
    state = tmp_path / "state"
    shard = Shard(old, "--state-dir", str(state)).wait_ready()
    reqs = requests(np.random.default_rng(3))
    try:
        before = answers(shard.address, reqs)
        data = deltas["i8"].read_bytes()
        step = {"op": "stage", "update": 5, "table": "i8", "kind": "rows", "offset": 0}
        assert _Shard(shard.address, 10).step({**step, "last": True}, data)["version"] == 1
        assert answers(shard.address, reqs) == before  # staged, not serving
        assert (state / "i8.v1.tbl").exists()
        shard.stop()
        shard = Shard(old, "--state-dir", str(state)).wait_ready()
        assert answers(shard.address, reqs) == before and version(shard, "i8") == 0
        assert [p.name for p in state.iterdir()] == [".lock"]
        # A second shard on the same directory would delete the first one's versions.
        other = Shard(old, "--state-dir", str(state))
        assert other.proc.wait(timeout=30) == 1
        other.stop()  # joins its output reader
        assert "another shard uses it" in other.process.output()
    finally:
        shard.stop()


def test_a_split_table_switches_at_one_time_on_every_shard(bundles, tmp_path):
    """Two shards, each half of table f32, the update's rows in both halves: a request that
    reads both halves sees one version whole, although the switch reaches the shards one
    after the other — each picks the version by the request's time against the common switch
    time (docs/tiers.md, "One version per request")."""
    old, _, fresh, deltas = bundles
    half, rows = ROWS["f32"] // 2, ROWS["f32"]
    halves = [(0, half), (half, rows)]
    shards = [
        Shard(old, "--rows", f"f32={a}:{b}", "--state-dir", str(tmp_path / f"s{i}")).wait_ready()
        for i, (a, b) in enumerate(halves)
    ]
    # The new version served split the same way (partial sums merged alike, bit for bit).
    refs = [Shard(fresh, "--rows", f"f32={a}:{b}").wait_ready() for a, b in halves]
    reqs = requests(np.random.default_rng(4), tables=("f32",))
    for r in reqs:
        r[2][::3] = rows - 1  # every bag reads the far half too (row 999 is updated)

    def split(over: list[Shard]) -> list[bytes]:
        routes = [("f32", a, b, s.address) for (a, b), s in zip(halves, over, strict=True)]
        return [o.tobytes() for o in _native.ShardClient(routes, timeout_s=10).lookup(reqs)]

    try:
        old_answer = split(shards)
        new_answer = split(refs)
        assert old_answer != new_answer
        data = deltas["f32"].read_bytes()
        step = {"update": 9, "table": "f32"}
        steppers = [_Shard(s.address, 10) for s in shards]
        for shard in steppers:
            shard.step({**step, "op": "stage", "kind": "rows", "offset": 0, "last": True}, data)
        switch_at = time.time() + 5.0
        switch = {**step, "op": "switch", "switch_at_unix_us": int(switch_at * 1e6)}
        assert steppers[0].step(switch)["version"] == 1
        # One shard has switched, the other not yet: a request before the switch time reads
        # the old version on both (at once, without it, the first half would be new).
        got = split(shards)
        if time.time() < switch_at:
            assert got == old_answer
        assert steppers[1].step(switch)["version"] == 1
        got = split(shards)
        if time.time() < switch_at:
            assert got == old_answer
        assert got in (old_answer, new_answer)
        time.sleep(max(0.0, switch_at - time.time()) + 0.05)
        assert split(shards) == new_answer
        assert [version(s, "f32") for s in shards] == [1, 1]
        # A switch that arrives after its time says by how much (the CLI warns).
        stage = {"update": 10, "table": "f32", "op": "stage", "kind": "rows", "offset": 0}
        steppers[0].step({**stage, "last": True}, data)
        past = int((time.time() - 1.0) * 1e6)
        late = steppers[0].step({**stage, "op": "switch", "switch_at_unix_us": past})
        assert late["version"] == 2 and late["late_us"] >= 1_000_000, late
    finally:
        for s in (*shards, *refs):
            s.stop()


def write_plan(tmp_path: Path, bundle: Path) -> Path:
    """A plan naming the bundle (all `cleave update` reads of it, with the secret's name)."""
    plan = Plan(
        name="m", bundle=str(bundle), mode="disaggregated", transport="tcp",
        hosts=[Host("h0", 2, 1.0, 0)], shards=[], rankers=[], routers=[],
        router=RouterConfig(), supervision=Supervision(False, 30.0, 10.0),
    )  # fmt: skip
    return save_plan(plan, tmp_path / "plan.yaml")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cleave.cli", "update", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_bad_updates_are_refused_and_the_old_version_keeps_serving(bundles, tmp_path):
    old, source, _, deltas = bundles
    state = tmp_path / "state"
    shard = Shard(old, "--state-dir", str(state)).wait_ready()
    plan = write_plan(tmp_path, old)
    reqs = requests(np.random.default_rng(4))
    m = manifest(old)
    wrong_rows = dict(m["f32"], rows=ROWS["f32"] + 10)
    far = write_delta(tmp_path / "far.delta", wrong_rows, [ROWS["f32"] + 5], np.ones((1, 16)))
    truncated = tmp_path / "short.delta"
    truncated.write_bytes(deltas["f32"].read_bytes()[:-3])
    # A port nothing listens on: the second shard is down during the stage.
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    cases = [
        (["--table", "f32", "--rows", str(deltas["f16"])], "is for table 'f16'"),
        (["--table", "wide", "--rows", str(deltas["f32"])], "is for table 'f32'"),
        (["--table", "f32", "--rows", str(truncated)], "truncated or padded"),
        (["--table", "f32", "--rows", str(tmp_path / "none.delta")], "none.delta: no such file"),
        (["--table", "nope", "--rows", str(deltas["f32"])], "--table 'nope'"),
        (["--table", "f32", "--file", str(source / "tables" / "f16.bin")], "expected 64000"),
        (["--table", "f32", "--rows", str(far)], "id 1005 (entry 0) is out of range"),
    ]
    try:
        before = answers(shard.address, reqs)
        for args, says in cases:
            proc = cli("--plan", str(plan), "--shard", shard.address, *args)
            assert proc.returncode != 0 and says in proc.stderr, (args, proc.stderr)
        proc = cli(
            "--plan", str(plan), "--shard", shard.address, "--shard", dead,
            "--table", "f32", "--rows", str(deltas["f32"]), "--timeout", "5",
        )  # fmt: skip
        assert proc.returncode != 0 and f"shard {dead}" in proc.stderr, proc.stderr
        assert "staged on" in proc.stderr  # the live shard had staged: it was aborted
        assert answers(shard.address, reqs) == before
        assert version(shard, "f32") == 0
        assert [p.name for p in state.iterdir()] == [".lock"]  # nothing staged or partial
        # The shard cannot write the new version (its name is taken by a directory, as a
        # full or failing disk would refuse it): refused naming the file, nothing left.
        (state / "f32.v1.tbl" / "x").mkdir(parents=True)
        proc = cli("--plan", str(plan), "--shard", shard.address, "--table", "f32",
                   "--rows", str(deltas["f32"]))  # fmt: skip
        assert proc.returncode != 0 and "f32.v1.tbl" in proc.stderr, proc.stderr
        assert answers(shard.address, reqs) == before
        assert sorted(p.name for p in state.iterdir()) == [".lock", "f32.v1.tbl"]
        shutil.rmtree(state / "f32.v1.tbl")
        ok = cli("--plan", str(plan), "--shard", shard.address, "--table", "f32",
                 "--rows", str(deltas["f32"]))  # fmt: skip
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["versions"] == {shard.address: 1}
    finally:
        shard.stop()


def test_a_shard_without_a_state_dir_refuses_updates(bundles):
    old, _, _, deltas = bundles
    shard = Shard(old).wait_ready()
    try:
        with pytest.raises(Exception, match="has no --state-dir"):
            apply_update([shard.address], "f32", deltas["f32"], "rows")
    finally:
        shard.stop()


def test_updates_prove_the_plans_internal_secret(bundles, tmp_path, monkeypatch):
    old, _, _, deltas = bundles
    monkeypatch.setenv("CLEAVE_INTERNAL_SECRET", "right")  # the shard's (docs/security.md)
    shard = Shard(old, "--state-dir", str(tmp_path / "state")).wait_ready()
    monkeypatch.delenv("CLEAVE_INTERNAL_SECRET")
    plan = write_plan(tmp_path, old)
    p = load_plan(plan)
    p.router.internal_secret_env = "UPDATE_TEST_SECRET"
    save_plan(p, plan)
    args = ["--plan", str(plan), "--shard", shard.address, "--table", "f32"]
    args += ["--rows", str(deltas["f32"])]
    try:
        monkeypatch.setenv("UPDATE_TEST_SECRET", "wrong")
        proc = cli(*args)
        assert proc.returncode != 0 and f"shard {shard.address}" in proc.stderr, proc.stderr
        assert version(shard, "f32") == 0
        monkeypatch.delenv("UPDATE_TEST_SECRET")
        proc = cli(*args)
        assert proc.returncode != 0 and "UPDATE_TEST_SECRET is unset" in proc.stderr
        monkeypatch.setenv("UPDATE_TEST_SECRET", "right")
        proc = cli(*args)
        assert proc.returncode == 0, proc.stderr
        assert version(shard, "f32") == 1
    finally:
        shard.stop()
