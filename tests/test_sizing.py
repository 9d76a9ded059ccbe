"""`cleave profile` and `cleave size`: a profile measured with a real shard process, a catalog,
the cheapest plan that meets a rate at a p99 (checked as `cleave plan --check` checks plans),
the queueing model against closed forms, and bad input refused with what was expected."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from cleave.bundle.manifest import served_dtypes
from cleave.cli import main
from cleave.plan.files import load_plan
from cleave.sizing import queueing
from cleave.sizing.catalog import parse_catalog
from cleave.sizing.profile import _time_ms
from cleave.sizing.search import RANKER_MAX_BATCH, dense_ms, ranker_overhead_ms
from support.cli import refused

CATALOG = {
    "machines": [
        {"kind": "c-4", "cpus": 4, "memory_gib": 16, "nic_gbit": 10, "price_per_hour": 0.17},
        {"kind": "c-16", "cpus": 16, "memory_gib": 64, "nic_gbit": 25, "price_per_hour": 0.68},
        {"kind": "m-16", "cpus": 16, "memory_gib": 128, "nic_gbit": 25, "price_per_hour": 0.9},
    ]
}


def run(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(args)) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def profiled(models, tmp_path_factory) -> dict:
    """dlrm and dcn (the DLRMv2-shaped model) profiled once, quick, and a catalog file."""
    root = tmp_path_factory.mktemp("sizing")
    catalog = root / "catalog.yaml"
    catalog.write_text(yaml.safe_dump(CATALOG))
    out = {"catalog": catalog, "root": root}
    for name, serve in (("dlrm", ["--no-serve"]), ("dcn", [])):  # one router timed: seconds
        path = root / f"{name}.json"
        flags = ["-o", str(path), "--quick", "--threads", "1,2", *serve]
        run("profile", str(models[name].dir), *flags)
        out[name] = path
    return out


def test_a_profile_holds_every_measurement(models, profiled):
    profile = json.loads(profiled["dcn"].read_text())
    manifest = json.loads((models["dcn"].dir / "manifest.json").read_text())
    assert set(profile["tables"]) == {t["name"] for t in manifest["tables"]}
    assert all(t["ns_per_id"] > 0 for t in profile["tables"].values())
    shard = profile["shard"]
    assert shard["cpu_us_per_request"] > 0 and shard["ids_per_request"] > 0
    # Every dtype the bundle approves, both thread counts, growing batch sizes.
    assert list(profile["dense"]) == served_dtypes(manifest)
    for per_threads in profile["dense"].values():
        assert set(per_threads) == {"1", "2"}
        for per_batch in per_threads.values():
            assert len(per_batch) >= 2 and all(ms > 0 for ms in per_batch.values())
    b = profile["bytes_per_candidate"]
    assert b["lookup_reply"] > 0 and b["rank"] >= b["lookup_reply"] and b["reply"] > 0
    hits = profile["cache"]["hit_rate"]
    assert hits == sorted(hits) and 0 < hits[-1] <= 1
    # The router, timed on the bundle served with requests synthesized from its manifest.
    router = profile["router"]
    assert router["measured"] and router["cpu_us_per_request"] > 0 and router["requests"] >= 50
    assert json.loads(profiled["dlrm"].read_text())["router"] == {
        "measured": False,
        "why": "not asked (--no-serve)",
    }


@pytest.mark.parametrize("name", ["dlrm", "dcn"])
def test_size_writes_the_cheapest_plan_that_checks(models, profiled, tmp_path, name):
    plan_path, explained = tmp_path / "plan.yaml", tmp_path / "size.json"
    # A target this machine's speed allows: the dense program's time sets the floor.
    profile = json.loads(profiled[name].read_text())
    p99 = max(25.0, 4 * dense_ms(profile, "float32", 1, 100))
    printed = run(
        "size", str(models[name].dir), "--rate", "2000", "--p99-ms", str(p99),
        "--catalog", str(profiled["catalog"]), "--profile", str(profiled[name]),
        "-o", str(plan_path), "--json", str(explained),
    )  # fmt: skip
    result = json.loads(explained.read_text())
    chosen = result["chosen"]
    assert chosen["p99_ms"] <= p99 and chosen["max_rate"] >= 2000
    assert all(p["cpu_utilization"] <= 0.7 and p["nic_utilization"] <= 0.7 for p in chosen["pools"])
    # No runner-up is cheaper than the choice.
    assert all(r["cost_per_hour"] >= chosen["cost_per_hour"] for r in result["runners_up"])
    assert "binding" in printed and "runner-up 1" in printed and "monolithic" in printed
    source = {"dlrm": "estimated", "dcn": "measured"}[name]
    assert result["router_cpu_us"]["source"] == source and f"({source})" in printed
    # The plan: every pool on its own labelled hosts, N+1 (two replicas, two routers).
    plan = load_plan(plan_path)
    pools = {h.name: h.labels["pool"] for h in plan.hosts}
    assert {pools[s.host] for s in plan.shards} == {"shards"}
    assert {pools[r.host] for r in plan.rankers} == {"rankers"}
    assert {pools[r.host] for r in plan.routers} == {"routers"}
    assert len(plan.routers) >= 2 and len({s.group for s in plan.shards}) * 2 == len(plan.shards)
    hosts = {p["pool"]: p["hosts"] for p in chosen["pools"]}
    assert sum(hosts.values()) == len(plan.hosts)
    assert "OK" in run("plan", "--check", str(plan_path))
    # A request the target lets be slow is not refused for it.
    assert plan.router.budget_ms >= max(1000.0, 2 * p99)
    cost = sum(p["cost_per_hour"] for p in chosen["pools"])
    assert math.isclose(cost, chosen["cost_per_hour"], rel_tol=1e-3)


def test_gpu_rankers_are_sized_from_a_gpu_profile_only(models, profiled, tmp_path):
    """A GPU kind runs rankers on its GPUs when the profile timed the dense program on one
    (here a GPU profile with fast batches, injected); without it the kind offers its CPUs."""
    gpu_kind = {"kind": "gpu-1", "cpus": 8, "memory_gib": 64, "nic_gbit": 25, "gpus": 2}
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(
        yaml.safe_dump({"machines": [*CATALOG["machines"], {**gpu_kind, "price_per_hour": 1.0}]})
    )
    cpu_profile = json.loads(profiled["dcn"].read_text())
    gpu_profile = tmp_path / "gpu-profile.json"
    fast = {"1": 0.05, "16": 0.06, "64": 0.08}
    gpu_profile.write_text(json.dumps(cpu_profile | {"cuda": {"dense": {"float32": fast}}}))
    chosen = {}
    p99 = str(max(50.0, 4 * dense_ms(cpu_profile, "float32", 1, 100)))  # this machine's floor
    for name, profile in (("gpu", gpu_profile), ("cpu", profiled["dcn"])):
        out = tmp_path / f"{name}.json"
        run(
            "size", str(models["dcn"].dir), "--rate", "20000", "--p99-ms", p99,
            "--catalog", str(catalog), "--profile", str(profile),
            "-o", str(tmp_path / f"{name}.yaml"), "--json", str(out),
        )  # fmt: skip
        chosen[name] = json.loads(out.read_text())["chosen"]
    assert chosen["gpu"]["device"] == "cuda" and chosen["gpu"]["kinds"]["rankers"] == "gpu-1"
    rankers = next(p for p in chosen["gpu"]["pools"] if p["pool"] == "rankers")
    assert rankers["servers_per_host"] == 2  # one ranker per GPU
    # Requests of 100 rows join a batch up to the rankers' max_batch: each costs its share.
    joined = RANKER_MAX_BATCH // 100
    batch = dense_ms(json.loads(gpu_profile.read_text()), "float32", "cuda", joined * 100)
    assert rankers["requests_per_batch"] == joined
    assert math.isclose(rankers["service_ms"], batch / joined, rel_tol=1e-3)
    plan = load_plan(tmp_path / "gpu.yaml")
    assert {r.device for r in plan.rankers} == {"cuda"}
    assert chosen["cpu"]["device"] == "cpu"  # no GPU timings: no GPU rankers
    assert chosen["gpu"]["cost_per_hour"] < chosen["cpu"]["cost_per_hour"]


def test_a_router_cache_is_chosen_when_it_saves_shard_hosts(models, profiled, tmp_path):
    """dcn's pooled rows are 13 KB per candidate: shards are bound by their NICs, and a router
    cache of the hottest rows (the profile's hit curve) saves shard hosts. With bags of two
    ids (which seldom repeat exactly) the search counts no hit and offers no cache."""
    results = {}
    for name, ids in (("one", 1.0), ("two", 2.0)):
        profile = json.loads(profiled["dcn"].read_text())
        profile["traffic"]["ids_per_candidate"] = ids
        path, out = tmp_path / f"{name}-profile.json", tmp_path / f"{name}.json"
        path.write_text(json.dumps(profile))
        p99 = str(max(100.0, 4 * dense_ms(profile, "float32", 1, 100)))  # this machine's floor
        run(
            "size", str(models["dcn"].dir), "--rate", "20000", "--p99-ms", p99,
            "--catalog", str(profiled["catalog"]), "--profile", str(path),
            "-o", str(tmp_path / f"{name}.yaml"), "--json", str(out),
        )  # fmt: skip
        results[name] = json.loads(out.read_text())["chosen"]
    cached, plain = results["one"], results["two"]
    assert cached["router_cache_bytes"] in profile["cache"]["bytes"]
    assert plain["router_cache_bytes"] == 0
    shards = {k: next(p for p in r["pools"] if p["pool"] == "shards") for k, r in results.items()}
    assert shards["one"]["hosts"] < shards["two"]["hosts"]
    plan = load_plan(tmp_path / "one.yaml")
    assert plan.router.cache == "fixed"
    assert plan.router.cache_bytes == cached["router_cache_bytes"]


def test_more_rate_costs_more_hosts(models, profiled, tmp_path):
    costs = []
    for rate in ("500", "20000"):
        out = tmp_path / f"{rate}.json"
        run(
            "size", str(models["dlrm"].dir), "--rate", rate, "--p99-ms", "25",
            "--catalog", str(profiled["catalog"]), "--profile", str(profiled["dlrm"]),
            "-o", str(tmp_path / f"{rate}.yaml"), "--json", str(out),
        )  # fmt: skip
        costs.append(json.loads(out.read_text())["chosen"]["cost_per_hour"])
    assert costs[1] > costs[0]


def test_bad_input_is_refused_with_what_was_expected(models, profiled, tmp_path):
    bundle, catalog = str(models["dlrm"].dir), str(profiled["catalog"])
    plan = tmp_path / "plan.yaml"
    common = ["-o", str(plan), "--profile", str(profiled["dlrm"])]
    # A profile of another bundle.
    err = refused("size", bundle, "--rate", "100", "--p99-ms", "25", "--catalog", catalog,
                  "-o", str(plan), "--profile", str(profiled["dcn"]))  # fmt: skip
    assert "measured on another bundle" in err and "cleave profile" in err
    # A catalog whose machines cannot hold the tables, even cut over every host it offers.
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(yaml.safe_dump({"machines": [{
        "kind": "t-1", "cpus": 1, "memory_gib": 0.05, "nic_gbit": 1, "price_per_hour": 0.01,
        "max_count": 1,
    }]}))  # fmt: skip
    err = refused(
        "size", bundle, "--rate", "100", "--p99-ms", "25", "--catalog", str(tiny), *common
    )
    assert "no machine in the catalog can hold the tables" in err and "1 x t-1" in err
    # Unreachable: a p99 below what one request takes, and a rate beyond what may be bought.
    err = refused(
        "size", bundle, "--rate", "100", "--p99-ms", "0.01", "--catalog", catalog, *common
    )
    assert "latency" in err and "the best it can do: p99" in err
    few = tmp_path / "few.yaml"
    few.write_text(yaml.safe_dump({"machines": [{**CATALOG["machines"][0], "max_count": 3}]}))
    err = refused("size", bundle, "--rate", "1e7", "--p99-ms", "25", "--catalog", str(few), *common)
    assert "more hosts than the catalog offers" in err and "/s at a p99 of 25 ms" in err
    assert not plan.exists()  # nothing written by a refusal
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    err = refused("size", bundle, "--rate", "1", "--p99-ms", "25", "--catalog", catalog,
                  "-o", str(plan), "--profile", str(garbage))  # fmt: skip
    assert "expected a profile JSON" in err
    err = refused("size", bundle, "--rate", "-1", "--p99-ms", "25", "--catalog", catalog, *common)
    assert "must be positive" in err
    # The capped runs' target without the capped runs, or not a target.
    out = str(tmp_path / "profile.json")
    err = refused("profile", bundle, "-o", out, "--p99-ms", "100")
    assert "--p99-ms" in err and "without --capped" in err
    err = refused("profile", bundle, "-o", out, "--p99-ms", "-5", "--capped", catalog)
    assert "expected a positive target" in err


@pytest.mark.parametrize(
    "machines, expected",
    [
        ("nope", "expected a mapping with a list `machines`"),
        ([], "expected at least one machine kind"),
        ([{"kind": "a", "cpus": 4, "memory_gib": 8, "nic_gbit": 10}], "price_per_hour: missing"),
        ([{**CATALOG["machines"][0], "cpus": -2}], "cpus: expected a positive int"),
        ([{**CATALOG["machines"][0], "cpus": 2.5}], "cpus: expected a int"),
        ([{**CATALOG["machines"][0], "gpu": 1}], "unknown keys ['gpu']"),
        ([{**CATALOG["machines"][0], "kind": "Big Box"}], "expected a DNS label"),
        ([CATALOG["machines"][0]] * 2, "kind 'c-4' is listed twice"),
    ],
)
def test_a_bad_catalog_names_the_field(machines, expected):
    from cleave.errors import UsageError

    data = machines if machines == "nope" else {"machines": machines}
    with pytest.raises(UsageError) as err:
        parse_catalog(data, "c.yaml")
    assert expected in str(err.value)


def test_the_shipped_example_catalog_reads():
    from cleave.sizing.catalog import load_catalog

    kinds = load_catalog(Path(__file__).parents[1] / "deploy" / "catalogs" / "example.yaml")
    assert len(kinds) >= 5 and any(k.gpus for k in kinds)


def test_erlang_c_matches_closed_forms():
    # M/M/1: an arrival waits with probability rho; M/M/2 at 1 Erlang: 1/3.
    assert math.isclose(queueing.erlang_c(1, 0.5), 0.5)
    assert math.isclose(queueing.erlang_c(2, 1.0), 1 / 3)
    assert queueing.erlang_c(4, 4.0) == 1.0
    # M/M/1's waiting tail: P(W > t) = rho * exp(-(mu - lambda) t).
    service, rate = 0.01, 50.0  # rho = 0.5
    want = service + math.log(0.5 / 0.01) / (100.0 - 50.0)
    assert math.isclose(queueing.p99_s(1, service, rate), want)
    assert queueing.p99_s(1, service, 100.0) == math.inf
    assert queueing.p99_s(8, service, 1.0) == service  # almost never waits


def test_dense_time_is_interpolated_between_batch_sizes():
    profile = {"dense": {"float32": {"1": {"1": 1.0, "10": 2.0, "20": 4.0}}}}
    assert dense_ms(profile, "float32", 1, 1) == 1.0
    assert math.isclose(dense_ms(profile, "float32", 1, 5), 1.0 + 4 / 9)
    assert math.isclose(dense_ms(profile, "float32", 1, 40), 8.0)  # beyond: the last slope


def test_the_rankers_overhead_is_what_its_cpu_spends_beyond_the_dense_program():
    dense = {"float32": {"1": {"32": 2.0, "64": 4.0}}}
    served = {"dense": dense, "router": {"ranker_cpu_us_per_request": 5000.0}}
    assert ranker_overhead_ms(served, 32) == pytest.approx(3.0)
    assert ranker_overhead_ms(served, 64) == pytest.approx(1.0)
    assert ranker_overhead_ms(served, 128) == 0.0  # the dense program alone costs more
    assert ranker_overhead_ms({"dense": dense, "router": {}}, 32) == 0.0  # not served


class _Waits(torch.nn.Module):
    """A call that takes 0.3 s of wall clock and almost no CPU, as a call does when another
    process holds the core."""

    def forward(self, x):
        time.sleep(0.3)
        return x + 1


def test_dense_timings_count_cpu_not_a_stretched_wall_clock():
    ms = _time_ms(_Waits(), (torch.ones(4),), runs=3, threads=1)
    assert ms < 150, ms  # the 300 ms it waited are not the program's


def test_pool_labels_place_each_role_on_its_pool(models):
    from cleave.errors import UsageError
    from cleave.plan.planner import make_plan
    from cleave.plan.schema import Host
    from cleave.settings import ServeConfig

    hosts = [Host(f"h{i}", 4, 16.0, 0, {"pool": p}) for i, p in enumerate(
        ["rankers", "shards", "routers", "shards"])]  # fmt: skip
    plan = make_plan(models["dlrm"].dir, hosts, 2, 2, 1, 1, ServeConfig())
    assert {s.host for s in plan.shards} == {"h1", "h3"}
    assert [r.host for r in plan.rankers] == ["h0"] and [r.host for r in plan.routers] == ["h2"]
    hosts[2] = Host("h2", 4, 16.0, 0, {})
    with pytest.raises(UsageError, match="h2: None.*none for \\['routers'\\]"):
        make_plan(models["dlrm"].dir, hosts, 2, 2, 1, 1, ServeConfig())


def test_a_request_slower_than_the_default_budget_does_not_end_the_profile(models, monkeypatch):
    """The router's profile times a request that outlasts the router's default budget (a
    starved core: it had answered 504, which ended `cleave profile`)."""
    import numpy as np
    from cleave.sizing import router
    from support.processes import processes_below

    manifest = json.loads((models["dlrm"].dir / "manifest.json").read_text())
    named = router.synthetic_inputs(manifest, 10, 1.0, np.random.default_rng(0))
    send, sent = router._send, []

    def first_timed_one_slow(conn, path, body):
        sent.append(path)
        if len(sent) == router.WARM_UP + 1:
            below = processes_below(os.getpid()).items()
            (ranker,) = [pid for pid, argv in below if "ranker" in argv]
            os.kill(ranker, signal.SIGSTOP)  # the default budget is 1 s
            threading.Timer(1.5, os.kill, (ranker, signal.SIGCONT)).start()
        send(conn, path, body)

    monkeypatch.setattr(router, "_send", first_timed_one_slow)
    measured = router.measure_router(models["dlrm"].dir, named, 0.1)
    assert measured["requests"] == router.MIN_REQUESTS == len(sent) - router.WARM_UP


def test_requests_are_synthesized_from_the_manifest_kjts_included():
    import numpy as np
    from cleave.sizing.router import Unsupported, _resolve, synthetic_inputs

    manifest = {
        "inputs": [
            {"name": "dense", "role": "dense", "shape": ["B", 3], "dtype": "float32"},
            {"name": "kjt.values", "role": "ids", "shape": ["N0"], "dtype": "int64"},
            {"name": "kjt.lengths", "role": "lengths", "shape": ["2*B"], "dtype": "int64"},
        ],
        "tables": [{"name": "t_a", "rows": 7}, {"name": "t_b", "rows": 1000}],
        "kjts": [
            {
                "name": "kjt",
                "keys": ["a", "b"],
                "values": "kjt.values",
                "lengths": "kjt.lengths",
                "weights": None,
            }
        ],  # fmt: skip
        "features": [
            {"name": "a", "layout": "kjt", "kjt": "kjt", "key": "a", "table": "t_a"},
            {"name": "b", "layout": "kjt", "kjt": "kjt", "key": "b", "table": "t_b"},
        ],
    }
    named = synthetic_inputs(manifest, 10, 3.0, np.random.default_rng(0))
    assert list(named) == ["dense", "kjt.values", "kjt.lengths"]
    assert named["dense"].shape == (10, 3) and named["kjt.lengths"].tolist() == [3] * 20
    values = named["kjt.values"].numpy()
    assert len(values) == 60 and values[:30].max() < 7 and values[30:].max() >= 7  # key order
    assert _resolve("B+1", {"B": 4}) == 5 and _resolve(5, {}) == 5
    with pytest.raises(Unsupported):
        _resolve("N9", {"B": 4})
    with pytest.raises(Unsupported):
        _resolve("__import__('os')", {"B": 4})


def test_a_capped_kinds_measured_cpu_sets_its_pools_latency_and_capacity(models, profiled):
    """`cleave profile --capped`'s factors (injected here): a pool of that kind serves one
    request in the low-load figure and saturates at the saturated one; a kind whose cap
    differs from the measured one keeps the catalog's cpu_speed."""
    from cleave.bundle import manifest as manifest_io
    from cleave.sizing.capped import model_cpu_ms
    from cleave.sizing.search import Sizer, Target

    profile = json.loads(profiled["dcn"].read_text())
    manifest = manifest_io.read(models["dcn"].dir, whole=False)
    tenth, other = parse_catalog(
        {
            "machines": [
                {"kind": "tb", "cpus": 1, "cpu_speed": 0.1, "memory_gib": 2, "nic_gbit": 1,
                 "price_per_hour": 1},
                {"kind": "tb-2", "cpus": 1, "cpu_speed": 0.2, "memory_gib": 2, "nic_gbit": 1,
                 "price_per_hour": 1},
            ]
        },
        "test",
    )  # fmt: skip
    plain = Sizer(manifest, profile, [tenth, other], Target(10, 1e4))
    low = {"routers": 3.0, "shards": 2.0, "rankers": 2.0}
    saturated = {"routers": 2.0, "shards": 1.0, "rankers": 0.5}
    profile["capped"] = {
        name: {
            "cores": 0.1,
            "low": {"factor": low},
            "saturated": {"factor": saturated},
            "wait_scale": 2.0,
        }
        for name in ("tb", "tb-2")  # tb-2's cap is 0.2: its figures were not measured on it
    }
    capped = Sizer(manifest, profile, [tenth, other], Target(10, 1e4))
    assert capped.calibrated() == ["tb"]
    pools = {
        "routers": lambda s, k: s.routers(k),
        "shards": lambda s, k: s.shards(k, 2),
        "rankers": lambda s, k: s.rankers(k, "float32", 1),
    }
    for role, make in pools.items():
        base, measured = make(plain, tenth), make(capped, tenth)
        assert measured.service_ms == pytest.approx(base.service_ms * low[role])
        assert measured.capacity_ms == pytest.approx(base.service_ms * saturated[role])
        assert measured.cpu_util(10) == pytest.approx(base.cpu_util(10) * saturated[role])
        assert make(capped, other).service_ms == pytest.approx(make(plain, other).service_ms)
    # Lightly loaded, a request sees its own (low-load) time: the ranker's doubled.
    ranker = pools["rankers"](capped, tenth)
    assert ranker.p99_ms(1e-6) == pytest.approx(ranker.service_ms)
    # Its capacity is the saturated figure's: half the plain ranker's time, twice the rate.
    base = pools["rankers"](plain, tenth)
    at_capacity = 1.001e3 / base.service_ms  # a hair above: no rounding keeps it finite
    assert math.isinf(base.p99_ms(at_capacity))
    assert math.isfinite(ranker.p99_ms(at_capacity))
    # Its wait is the queue's at that capacity, times the measured scale.
    rate, s = 0.5e3 / ranker.capacity_ms, ranker.capacity_ms / 1e3
    wait = (queueing.p99_s(1, s, rate) - s) * 1e3
    assert ranker.p99_ms(rate) == pytest.approx(ranker.service_ms + 2.0 * wait)
    # Each host is its own queue: two rankers at twice the rate wait as one does.
    assert ranker.p99_ms(2 * rate, hosts=2) == pytest.approx(ranker.p99_ms(rate))
    # The whole-core figures the factors are over: what the profile says each role spends.
    model = model_cpu_ms(plain, 2)
    assert model["routers"] == pytest.approx(plain.router_us / 1e3)
    assert model["rankers"] == pytest.approx(base.service_ms * tenth.cpu_speed)


def dcn_on_a_testbed_kind(models, profiled, cores: float = 0.1) -> tuple[dict, dict, object]:
    """dcn's profile and manifest, and one testbed-like kind of one core at `cores` speed."""
    from cleave.bundle import manifest as manifest_io

    profile = json.loads(profiled["dcn"].read_text())
    manifest = manifest_io.read(models["dcn"].dir, whole=False)
    (kind,) = parse_catalog(
        {
            "machines": [
                {"kind": "tb", "cpus": 1, "cpu_speed": cores, "memory_gib": 2, "nic_gbit": 1,
                 "price_per_hour": 1}
            ]
        },
        "test",
    )  # fmt: skip
    return profile, manifest, kind


def test_a_capped_rankers_capacity_is_what_it_batched_within_the_target(models, profiled):
    """The saturated factor follows the target: the measured step whose p99 met it at the
    highest rate, towards the next step's as the target nears that step's p99; below every
    step the low-load figure; beyond every step the most loaded one."""
    from cleave.sizing.search import Sizer, Target

    profile, manifest, kind = dcn_on_a_testbed_kind(models, profiled)
    roles = ("routers", "shards", "rankers")
    steps = [  # the ranker's factor falls as the load (and its batches) grows
        {"rate": 10, "p99_ms": 20.0, "factor": dict.fromkeys(roles, 2.0)},
        {"rate": 20, "p99_ms": 60.0, "factor": dict.fromkeys(roles, 1.5)},
        {"rate": 30, "p99_ms": 100.0, "factor": dict.fromkeys(roles, 1.0)},
    ]
    profile["capped"] = {
        "tb": {
            "cores": 0.1,
            "low": {"factor": dict.fromkeys(roles, 3.0)},
            "saturated": {"factor": dict.fromkeys(roles, 1.0)},
            "steps": steps,
        }
    }

    def factor(p99_ms):
        sizer = Sizer(manifest, profile, [kind], Target(1, p99_ms))
        return sizer.speeds(kind, "rankers")[1]

    assert factor(10) == pytest.approx(0.1 / 3.0)  # no step met it: the low-load figure
    assert factor(20) == pytest.approx(0.1 / 2.0)
    assert factor(40) == pytest.approx(0.1 / 1.75)  # halfway to the next step's p99
    assert factor(60) == pytest.approx(0.1 / 1.5)
    assert factor(500) == pytest.approx(0.1 / 1.0)  # beyond every step: the most loaded


def test_steps_cross_a_target_where_the_first_one_misses_it():
    """As validate.py's search meets it: the last step within before the first that is not
    (a later step within, by chance, does not count), a step with more than 1% refused
    misses, and the target lies between the two by their p99s."""
    from cleave.sizing.capped import crossing, crossing_rate

    def step(rate, p99, errors=0):
        return {"rate": rate, "p99_ms": p99, "errors": errors, "sent": 1000}

    steps = [step(10, 20.0), step(20, 60.0), step(30, 140.0), step(40, 90.0)]
    assert crossing(steps, 100.0) == (1, 0.5, True)
    assert crossing_rate(steps, 100.0) == pytest.approx(25.0)
    assert crossing_rate(list(reversed(steps)), 100.0) == pytest.approx(25.0)  # any order
    refused = [step(10, 20.0), step(20, 30.0, errors=11), step(30, 40.0)]
    assert crossing(refused, 100.0) == (0, 0.0, True)  # missed by its refusals alone
    assert crossing(steps, 10.0) is None  # none met it
    assert crossing(steps, 500.0) == (3, 0.0, False)  # none missed it
    assert crossing_rate(steps, 500.0) is None


def test_the_wait_is_fitted_to_where_the_measured_deployment_crossed_the_target(models, profiled):
    """A kind measured on capped hosts: the model's pools of the measured deployment (two
    routers, three shard hosts, two rankers) reach the target at the rate where the steps'
    p99 crossed it, whatever the queueing model alone would say; a plan of that shape is
    predicted at that rate, and one with twice the rankers and routers at more."""
    from cleave.sizing.capped import calibration_pools
    from cleave.sizing.search import Mix, Sizer, Target

    profile, manifest, kind = dcn_on_a_testbed_kind(models, profiled)
    roles = ("routers", "shards", "rankers")
    hosts = {"routers": 2, "shards": 3, "rankers": 2}
    probe = Sizer(manifest, profile, [kind], Target(1, 1e4))
    capacity = 1e3 / probe.regrown(probe.rankers(kind, "float32", 1), 2).capacity_ms * 2
    rates = [0.2 * capacity, 0.4 * capacity, 0.6 * capacity]
    # Targets the model of the measured deployment reaches at 0.3 and 0.5 of the capacity with
    # a wait four times M/M/c's, and steps whose p99 crosses each there: set from the model,
    # so that they hold whatever this machine measured the roles at (fixed targets of seconds
    # were within reach of a loaded machine's profile without any scaling).
    model_pools = calibration_pools(probe, kind, hosts)
    for p in model_pools:
        p.wait_scale = 4.0
    model = Mix(model_pools, probe.fixed_ms(model_pools))
    goals = (model.p99_ms(0.3 * capacity), model.p99_ms(0.5 * capacity))
    middle = sum(goals) / 2
    p99s = (2 * goals[0] - middle, middle, 2 * goals[1] - middle)
    steps = [
        {"rate": r, "p99_ms": p99, "errors": 0, "sent": 500, "factor": dict.fromkeys(roles, 1.0)}
        for r, p99 in zip(rates, p99s, strict=True)
    ]
    profile["capped"] = {
        "tb": {
            "cores": 0.1,
            "hosts": hosts,
            "low": {"factor": dict.fromkeys(roles, 1.0)},
            "saturated": {"factor": dict.fromkeys(roles, 1.0)},
            "steps": steps,
            "wait_scale": 1.0,
        }
    }
    for goal, crossed in zip(goals, (0.3 * capacity, 0.5 * capacity), strict=True):
        sizer = Sizer(manifest, profile, [kind], Target(0.01 * crossed, goal))
        pools = calibration_pools(sizer, kind, hosts)
        mix = Mix(pools, sizer.fixed_ms(pools))
        assert mix.max_rate(Target(1, goal)) == pytest.approx(crossed, rel=0.01)
        assert sizer.wait_scale(kind) == pytest.approx(4.0, rel=0.01)  # slower than M/M/c
        chosen = sizer.size()["chosen_mix"]  # the smallest plan: the measured shape
        assert {p.name: p.hosts for p in chosen.pools} == hosts
        assert chosen.max_rate(Target(1, goal)) == pytest.approx(crossed, rel=0.01)
        doubled = [sizer.regrown(p, 2 * p.hosts) if p.name != "shards" else p for p in pools]
        assert Mix(doubled, sizer.fixed_ms(doubled)).max_rate(Target(1, goal)) > 1.5 * crossed


def test_a_testbed_plan_must_fit_the_machines_caps(models, profiled):
    """With a testbed catalog every plan is one the testbed can serve: its hosts' caps add up
    to at most what this machine leaves them, else the constraint is named."""
    from cleave.errors import UsageError
    from cleave.sizing.search import Sizer, Target

    profile, manifest, kind = dcn_on_a_testbed_kind(models, profiled)
    hosts = Sizer(manifest, profile, [kind], Target(1, 1e4), cap_room=1.0).size()["chosen_mix"]
    caps = sum(p.hosts for p in hosts.pools) * 0.1
    with pytest.raises(UsageError, match=f"testbed: the hosts' CPU caps add up to {caps:g} cores"):
        Sizer(manifest, profile, [kind], Target(1, 1e4), cap_room=caps - 0.05).size()


def test_the_capped_runs_serve_the_smallest_plan_that_fits_the_machine(models, profiled):
    """`cleave profile --capped` serves a kind as the smallest plan cleave size writes on it;
    where those caps do not fit this machine beside the load generator's core, one path of
    hosts; where not even that does, a clear error before anything is served."""
    from cleave.errors import UsageError
    from cleave.sizing.capped import ONE_PATH, calibration_hosts
    from cleave.sizing.catalog import testbed_room
    from cleave.sizing.search import Sizer, Target

    room = testbed_room()
    # A request every 20 s: each pool's fewest hosts is its least however slowly a loaded
    # machine profiled (at 1/s a CI run's measured ranker needed two capped hosts).
    rare = 0.05

    def hosts(cores):
        profile, manifest, kind = dcn_on_a_testbed_kind(models, profiled, cores)
        return calibration_hosts(Sizer(manifest, profile, [kind], Target(rare, 500)), kind)

    assert hosts(room / 7) == {"routers": 2, "shards": 3, "rankers": 2}
    assert hosts(room / 5) == ONE_PATH
    with pytest.raises(UsageError, match="even one path of its hosts"):
        hosts(room / 3)
