"""`cleave bench serve --overload` and `--soak` (real deployments, real load generators:
cleave-loadgen and vegeta): what they report, the pinned layout, and their flags. No timing
is asserted."""

from __future__ import annotations

import os
import re

import pytest
from support.bench import serve_bench
from support.cli import refused


def test_bench_serve_overload_and_soak_report_what_they_measured(tmp_path):
    # The capacity measured closed loop, a burst over it, the generator on a core of its own.
    flags = ["--duration", "1", "--bursts", "3", "--idle-connections", "20"]
    # the command's default dtype: an overload measures the rankers' choice, no float32 twin
    result, report = serve_bench(
        tmp_path, "--overload", *flags, "--idle-wait-s", "1", dtype_choice=True
    )
    (dep,) = report["deployments"].values()
    capacity = dep["capacity_rps"]
    assert capacity > 0 and dep["capacity_clients"] == 8 and dep["budget_ms"] == 1000.0
    assert list(dep["bursts"]) == ["3"]
    for factor, burst in zip((3.0,), dep["bursts"].values(), strict=True):
        assert list(burst["phases"]) == ["before", "burst", "after"]
        rates = [p["rate"] for p in burst["phases"].values()]
        assert rates == pytest.approx([0.4 * capacity, factor * capacity, 0.4 * capacity])
        sent = sum(p["sent"] for p in burst["phases"].values())
        assert sum(s["sent"] for s in burst["timeline"]) == sent
        # The router's counters saw the run: each request sent was admitted or refused (one
        # refused after its body was read counts as both), or given up by the client before
        # the router read it, which a starved machine (a full suite's workers on the server's
        # core) does to a burst: those the report counts.
        assert burst["admitted"] <= sent <= burst["admitted"] + burst["shed"] + lost(burst)
        assert burst["phases"]["before"]["router_cpu_s"] > 0
        # The refusals by reason, phase by phase (scraped at the boundaries), add up to them all.
        reasons = [p["shed_by_reason"] for p in burst["phases"].values()]
        assert sum(n for r in reasons for n in r.values()) == burst["shed"], reasons
        assert {k for r in reasons for k in r} <= {"connections", "in_flight", "estimate", "limit"}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        assert report["layout"] == {"server_cpus": cores[:-1], "client_cpus": cores[-1:]}
    assert dep["idle_connections"]["opened"] == 20
    assert "expired after admission" in result.stdout and (tmp_path / "serve.png").exists()

    result, report = serve_bench(tmp_path, "--soak", "0.1", "--capacity", "40")
    (dep,) = report["deployments"].values()
    roles = {name.split()[0] for name in dep["processes"]}
    assert {"router", "shard-0", "ranker-0"} <= roles
    for proc in dep["processes"].values():
        assert proc["rss_median_mib"] > 0 and proc["fds_max"] >= proc["fds_min"] > 0
        assert 0 < proc["private_median_mib"] <= proc["rss_median_mib"]
    assert dep["windows"] and "max dev %" in result.stdout
    # The router counts its live heap: some of its private memory, never more.
    heap = dep["router_heap"]
    (router,) = [p for name, p in dep["processes"].items() if name.startswith("router")]
    assert 0 < heap["median_mib"] < router["private_median_mib"]
    assert len(heap["live"]) == len(heap["t"]) > 0 and "router live heap" in result.stdout


def lost(burst: dict) -> int:
    """A burst's requests the client gave up on (timeouts) or could not send."""
    return burst["client_timeouts"] + burst["connection_errors"]


def test_pin_layouts_parse_and_refuse_bad_specs(monkeypatch):
    from cleave.bench import machine
    from cleave.errors import UsageError

    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    assert machine.parse_pin("auto") == ([0, 1, 2], [3])
    assert machine.parse_pin("off") == (None, None)
    assert machine.parse_pin("0-1,3:2") == ([0, 1, 3], [2])
    for spec, message in [
        ("0-1", "expected SERVER:CLIENT"),
        ("a:1", "expected SERVER:CLIENT"),
        ("0:1:2", "expected SERVER:CLIENT"),
        ("0-4:5", "may use CPUs [0, 1, 2, 3] only"),
        ("0-1:1", "share CPUs"),
    ]:
        with pytest.raises(UsageError, match=re.escape(message)):
            machine.parse_pin(spec)
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda _pid: {5})
    assert machine.parse_pin("auto") == (None, None)  # one core: nothing to separate


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--overload", "--bursts", "3,x"], "--bursts: expected factors > 0"),
        (["--overload", "--bursts", "0"], "--bursts: expected factors > 0"),
        (["--overload", "--pin", "0-1"], "--pin: expected SERVER:CLIENT"),
        (["--soak", "0"], "--soak takes minutes > 0"),
        (["--overload", "--shard-hosts", "1,2"], "measure one deployment (a bundle or --plan)"),
        (
            ["--overload", "--plan", "p.yaml", "--incast-control", "off,on"],
            "measure one deployment: drop --incast-control",
        ),
    ],
)
def test_bench_serve_refuses_bad_stress_flags(flags, message):
    assert message in refused("bench", "serve", *flags)


def test_bench_serve_overload_with_vegeta_as_the_generator(tmp_path):
    """The independent generator (vegeta, built by `make tools`) sends the bursts; its
    results are read back into the same report."""
    flags = ["--capacity", "40", "--duration", "1", "--bursts", "3", "--generator", "vegeta"]
    result, report = serve_bench(tmp_path, "--overload", *flags)
    (dep,) = report["deployments"].values()
    assert dep["generator"] == "vegeta" and list(dep["bursts"]) == ["3"]
    assert dep["dense_dtype_served"] == "float32"  # the rankers' own word, from /metrics
    burst = dep["bursts"]["3"]
    # vegeta sends at a constant rate, each phase's rate times its second at most (fewer when
    # it falls behind on a busy machine), and its every result comes back, placed where
    # vegeta scheduled it (a clean clone's run, placed by when vegeta sent: 16, 119, 17).
    sent = [p["sent"] for p in burst["phases"].values()]
    assert 0 < sent[0] <= 16 and 0 < sent[1] <= 120 and 0 < sent[2] <= 16, sent
    assert sum(s["sent"] for s in burst["timeline"]) == sum(sent)
    assert burst["admitted"] <= sum(sent) <= burst["admitted"] + burst["shed"] + lost(burst)
    reasons = [p["shed_by_reason"] for p in burst["phases"].values()]
    assert sum(n for r in reasons for n in r.values()) == burst["shed"], reasons
    assert burst["phases"]["before"]["goodput_rps"] > 0
    assert "bursts sent by vegeta" in result.stdout


def test_vegeta_results_say_what_failed():
    import socket

    from cleave.bench import vegeta

    with socket.socket() as a, socket.socket() as b:  # bound, never listening: refused
        for held in (a, b):
            held.bind(("127.0.0.1", 0))
        urls = [f"http://127.0.0.1:{held.getsockname()[1]}/x" for held in (a, b)]
        samples = vegeta.open_loop_phases(urls, [b"{}"], [(20, 0.5)], 1.0)
    assert len(samples) == 10 and {s.error for s in samples} == {"connection"}
    # In its own words, less what differs per request (the URL, the addresses).
    assert {s.detail for s in samples} == {"dial tcp: connect: connection refused"}
    # The rate is shared by the URLs (a plan's routers), each body to each in turn.
    assert sorted(s.router for s in samples) == [0] * 5 + [1] * 5


def test_a_request_vegeta_sent_late_stays_in_its_phase_and_counts_its_lag():
    from cleave.bench.vegeta import _samples

    def row(sent_s, seq, status=200, latency_s=0.002):
        # vegeta's CSV: timestamp ns, status, latency ns, bytes out, in, error, body, name, seq
        return [str(int(sent_s * 1e9)), str(status), str(int(latency_s * 1e9)), "0", "0", "", "",
                "", str(seq)]  # fmt: skip

    t0 = 1_000.0
    before = [row(t0 + 0.1 * n, n) for n in range(9)] + [row(t0 + 1.05, 9)]  # 10/s, last late
    burst = [row(t0 + 7 + n / 100, n, 503) for n in range(3)]  # its own attack: seq from 0
    samples = _samples([(0, before), (1, burst)], [(10, 1.0), (100, 2.0)], bodies=2)
    late = samples[9]
    assert late.scheduled_s == 0.9 and late.index == 1
    assert abs(late.lag_s - 0.15) < 1e-9 and abs(late.latency_s - 0.152) < 1e-9
    assert [s.lag_s for s in samples[:9]] == [0.0] * 9
    assert [s.scheduled_s for s in samples[10:]] == [1.0, 1.01, 1.02]
    assert {s.error for s in samples[10:]} == {"http_503"}
