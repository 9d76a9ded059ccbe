"""`cleave bench incast`: many senders, one ranker, one shaped link (docs/traffic.md).

On the emulated testbed (docs/testbed.md) host h0 is the ranker, hosts h1.. run the senders
(`cleave-incast senders`, several per host). In each incast event every one of the S senders
sends one message of M MiB to the ranker at about the same instant (as a fan-out's replies
do); events come every S·M / (0.8·B) on average (gaps drawn in ±20%), so the offered load is
80% of the ranker's link B: incast is about bursts, not overload. A message's SLO is k·M/B
with k from a fixed mix of tight and loose values, counted from when it was made. Control
traffic (requests-to-send, grants, credits) goes in the testbed's priority htb class.

Cases per incast size S: no control (every request granted at once, FCFS); fixed windows
(a sweep of sizes, FCFS and EDF); the adaptive window (FCFS and EDF). Then credits: with
senders loading the link continuously, one sender sends a credit every 10 ms both on the
priority control channel and piggybacked on its data connection; the ranker measures each
one-way (the emulated hosts share one clock).

Metrics per case: a message fails when it arrives after its SLO (or never): the router
waiting for it has given up, so failed_fraction and slo_attainment are complements here.
p99_ms is over delivered messages; goodput_mib_s is the MiB that met their SLO per second of
the offered period (the same span for every case of one size).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cleave.bench.harness.command import counts
from cleave.bench.harness.summary import nearest_rank
from cleave.errors import CleaveError, UsageError

MIB = 1 << 20
MIX = "50:0.4,150:0.6"  # k of SLO = k·M/B: 40% tight, 60% loose (docs/traffic.md: why)
LOAD = 0.8
CONTROL_PORT = 7400  # the priority class matches it; data ports follow it
PORT_SPAN = 40  # cases use CONTROL_PORT + 1 + 2i (data) so no TIME_WAIT is ever in the way
CREDIT_PROBE_MS = 10
READY_TIMEOUT_S = 120.0  # a ranker imports torch: many seconds on a busy machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", help="write the results here (and the plot beside it)")
    parser.add_argument("--plot", help="the PNG (default: the --json path with .png)")
    parser.add_argument("--quick", action="store_true", help="CI: small messages, few cases")
    parser.add_argument("--message-mib", type=float, help="M (default 8; quick 0.25)")
    parser.add_argument("--incast", help="comma-separated S (default 10,20,100; quick 10)")
    parser.add_argument("--windows", help="fixed windows in messages (default 1,4,16; quick 1)")
    parser.add_argument("--link-gbit", type=float, default=1.0)
    parser.add_argument("--sender-hosts", type=int, default=4)
    parser.add_argument(
        "--case-s", type=float, help="offered seconds per case (default 20; quick 2)"
    )
    parser.add_argument("--credit-s", type=float, help="credit probe seconds (default 10)")
    parser.add_argument("--mix", default=MIX, help=f"SLO multipliers k:weight (default {MIX})")
    parser.add_argument("--seed", type=int, default=1)


def find_incast_binary() -> str:
    """`cleave-incast`, where the other executables are looked for (make setup puts it beside
    the interpreter)."""
    bin_dir = os.environ.get("CLEAVE_BIN_DIR")
    for candidate in ([Path(bin_dir) / "cleave-incast"] if bin_dir else []) + [
        Path(sys.executable).parent / "cleave-incast"
    ]:
        if os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("cleave-incast")
    if found:
        return found
    raise CleaveError(
        "cleave-incast: not found beside the interpreter nor on PATH; build it with `make "
        "setup` (or `cargo build --release -p cleave-flow`) or set CLEAVE_BIN_DIR"
    )


def settings(args: argparse.Namespace) -> dict:
    quick = args.quick
    s = {
        "message_bytes": round((args.message_mib or (0.25 if quick else 8.0)) * MIB),
        "incast": counts(args.incast or ("10" if quick else "10,20,100"), "--incast"),
        "windows": counts(args.windows or ("1" if quick else "1,4,16"), "--windows"),
        "case_s": args.case_s or (2.0 if quick else 20.0),
        "credit_s": args.credit_s or (2.0 if quick else 10.0),
        "link_gbit": args.link_gbit,
        "sender_hosts": args.sender_hosts,
        "mix": args.mix,
        "seed": args.seed,
        "quick": quick,
    }
    if s["message_bytes"] < 1024:
        raise UsageError(f"--message-mib must give at least 1 KiB, got {args.message_mib}")
    if not 1 <= s["sender_hosts"] <= 16:
        raise UsageError(f"--sender-hosts must be 1..16, got {s['sender_hosts']}")
    return s


def cases(s: dict) -> list[dict]:
    """Every case of the run, in order. Quick keeps one fixed window and EDF adaptive."""
    out = []
    for n in s["incast"]:
        out.append({"incast": n, "control": "none", "order": "fcfs", "window_msgs": None})
        for w in s["windows"]:
            for order in ("fcfs", "edf"):
                out.append({"incast": n, "control": "fixed", "order": order, "window_msgs": w})
        for order in ("edf",) if s["quick"] else ("fcfs", "edf"):
            out.append({"incast": n, "control": "adaptive", "order": order, "window_msgs": None})
    return out


def _wait_ready(proc: subprocess.Popen, what: str) -> None:
    """Reads the child's stdout up to its "ready" line. Byte by byte from the descriptor: a
    buffered readline may take the "ready" line in with the one before it (the ranker prints
    "listening ..." first), and select would then wait for bytes already read; what follows
    the line stays unread for `communicate`."""
    fd = proc.stdout.fileno()
    line = b""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if not select.select([fd], [], [], 0.2)[0]:
            continue
        byte = os.read(fd, 1)
        if not byte:
            break
        if byte != b"\n":
            line += byte
        elif line.strip() == b"ready":
            return
        else:
            line = b""
    raise CleaveError(f"{what} did not print 'ready' within {READY_TIMEOUT_S:.0f} s")


def _groups(n: int, hosts: int) -> list[tuple[int, int]]:
    """(first index, count) of the senders on each sender host, spread evenly."""
    hosts = min(hosts, n)
    out, first = [], 0
    for h in range(hosts):
        count = n // hosts + (1 if h < n % hosts else 0)
        out.append((first, count))
        first += count
    return out


def _run(tb, binary: str, s: dict, case: dict, port: int, continuous: bool = False) -> dict:
    """One case: the ranker on h0, senders on the other hosts; the ranker's JSON report."""
    n, m = case["incast"], s["message_bytes"]
    link_bps = s["link_gbit"] * 1e9 / 8
    period_ms = n * m / (LOAD * link_bps) * 1e3
    span_s = s["credit_s"] if continuous else s["case_s"]
    events = 1 if continuous else max(3, round(span_s * 1e3 / period_ms))
    if continuous:
        period_ms = span_s * 1e3
    offered_s = events * period_ms / 1e3
    drain_s = 10.0 + 1.5 * n * m / link_bps
    window = 0
    if case["control"] == "fixed":
        window = case["window_msgs"] * m
    ranker_argv = [binary, "ranker", "--listen", tb.hosts[0].address]
    ranker_argv += ["--control-port", str(CONTROL_PORT), "--data-port", str(port)]
    ranker_argv += ["--senders", str(n), "--window", str(window), "--order", case["order"]]
    ranker_argv += ["--link-gbit", str(s["link_gbit"]), "--message-bytes", str(m)]
    ranker_argv += ["--max-s", str(offered_s + drain_s + 30)]
    if case["control"] == "adaptive":
        ranker_argv.append("--adaptive")
    if case["control"] != "none":
        ranker_argv.append("--drop-expired")
    with tempfile.TemporaryFile("w+") as ranker_err:
        ranker = tb.popen(0, ranker_argv, stdout=subprocess.PIPE, stderr=ranker_err, text=True)
        try:
            _wait_ready(ranker, "the incast ranker")
            start_ns = time.monotonic_ns() + 300_000_000
            senders = []
            for h, (first, count) in enumerate(_groups(n, s["sender_hosts"]), start=1):
                argv = [binary, "senders", "--ranker", tb.hosts[0].address]
                argv += ["--control-port", str(CONTROL_PORT), "--data-port", str(port)]
                argv += ["--first", str(first), "--count", str(count)]
                argv += ["--message-bytes", str(m), "--link-gbit", str(s["link_gbit"])]
                argv += ["--events", str(events), "--period-ms", f"{period_ms:.3f}"]
                argv += ["--start-ns", str(start_ns), "--mix", s["mix"], "--seed", str(s["seed"])]
                argv += ["--drain-s", f"{drain_s:.1f}"]
                if continuous:
                    argv.append("--continuous")
                    if h == 1:
                        argv += ["--credit-probe-ms", str(CREDIT_PROBE_MS)]
                senders.append(tb.popen(h, argv, stderr=subprocess.DEVNULL))
            limit = offered_s + drain_s + 20
            for p in senders:
                p.wait(timeout=limit)
            out, _ = ranker.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            raise CleaveError(f"incast case {case} did not finish in time") from None
        finally:
            if ranker.poll() is None:
                ranker.kill()
                ranker.wait(timeout=5)
        if ranker.returncode != 0 or not out.strip():
            ranker_err.seek(0)
            raise CleaveError(
                f"the incast ranker exited {ranker.returncode}: {ranker_err.read()[-2000:]}"
            )
    report = json.loads(out.strip().splitlines()[-1])
    report["offered_s"] = offered_s
    return report


def summarize(case: dict, report: dict, message_bytes: int) -> dict:
    msgs = report["messages"]
    met = [b for b, slo, lat in msgs if lat is not None and lat <= slo]
    failed = 1.0 - len(met) / len(msgs) if msgs else 1.0
    delivered = [lat / 1e3 for _, _, lat in msgs if lat is not None]
    p99 = nearest_rank(delivered, 0.99)
    return {
        "incast": case["incast"],
        "control": case["control"],
        "order": case["order"],
        "window_bytes": case["window_msgs"] * message_bytes if case["window_msgs"] else None,
        "failed_fraction": round(failed, 4),
        "slo_attainment": round(1.0 - failed, 4),
        "p99_ms": round(p99, 2) if p99 is not None else None,
        "goodput_mib_s": round(sum(met) / MIB / report["offered_s"], 2),
    }


def run_bench(s: dict) -> tuple[dict, dict]:
    """All cases and the credit probe on one testbed; (the JSON of the issue, details)."""
    from cleave.testbed import Testbed

    binary = find_incast_binary()
    results, details = [], {"window_traces": [], "messages": []}
    with Testbed(1 + s["sender_hosts"], link_gbit=s["link_gbit"]) as tb:
        tb.prioritize_port(CONTROL_PORT)
        all_cases = cases(s)
        for i, case in enumerate(all_cases):
            port = CONTROL_PORT + 1 + 2 * (i % PORT_SPAN)
            report = _run(tb, binary, s, case, port)
            row = summarize(case, report, s["message_bytes"])
            results.append(row)
            details["window_traces"].append(report["window_trace"])
            details["messages"].append(len(report["messages"]))
            trace = [w for _, w in report["window_trace"]]
            span = f" window {min(trace) / MIB:g}-{max(trace) / MIB:g}M" if trace else ""
            span += f" expired {report.get('expired', 0)}"
            print(_row_text(row, len(report["messages"])) + span, file=sys.stderr, flush=True)
        load_case = {"incast": 20, "control": "none", "order": "fcfs", "window_msgs": None}
        port = CONTROL_PORT + 1 + 2 * PORT_SPAN
        report = _run(tb, binary, s, load_case, port, continuous=True)
    prio, piggy = report["credits_priority_us"], report["credits_piggyback_us"]
    credits = {
        "priority_p99_us": round(nearest_rank(prio, 0.99) or 0.0, 1),
        "piggyback_p99_us": round(nearest_rank(piggy, 0.99) or 0.0, 1),
    }
    details["credit_samples"] = {"priority": len(prio), "piggyback": len(piggy)}
    details["credit_p50_us"] = {
        "priority": nearest_rank(prio, 0.5),
        "piggyback": nearest_rank(piggy, 0.5),
    }
    return {"cases": results, "credits": credits}, details


HEADER = (
    f"{'S':>4} {'control':>8} {'order':>5} {'window':>8} {'msgs':>5} {'failed':>7} "
    f"{'SLO met':>7} {'p99 ms':>8} {'goodput MiB/s':>13}"
)


def _row_text(r: dict, msgs: int | None = None) -> str:
    w = f"{r['window_bytes'] / MIB:g}M" if r["window_bytes"] else "-"
    p99 = f"{r['p99_ms']:.0f}" if r["p99_ms"] is not None else "-"
    return (
        f"{r['incast']:>4} {r['control']:>8} {r['order']:>5} {w:>8} "
        f"{msgs if msgs is not None else '':>5} {r['failed_fraction']:>7.1%} "
        f"{r['slo_attainment']:>7.1%} {p99:>8} {r['goodput_mib_s']:>13.1f}"
    )


def table(result: dict) -> str:
    lines = [HEADER] + [_row_text(r) for r in result["cases"]]
    c = result["credits"]
    lines.append(
        f"credits under load, p99: priority channel {c['priority_p99_us']:.0f} µs, "
        f"piggybacked on data {c['piggyback_p99_us']:.0f} µs"
    )
    return "\n".join(lines)


def plot(result: dict, path: str | Path) -> Path:
    """Per incast size: failed fraction and goodput of every case, side by side."""
    from cleave.bench.plot import pyplot, save_figure

    plt = pyplot()

    sizes = sorted({r["incast"] for r in result["cases"]})
    fig, axes = plt.subplots(2, len(sizes), figsize=(5 * len(sizes), 7), squeeze=False)
    for col, n in enumerate(sizes):
        rows = [r for r in result["cases"] if r["incast"] == n]
        labels = [
            f"{r['control']}\n{r['order']}"
            + (f"\n{r['window_bytes'] / MIB:g}M" if r["window_bytes"] else "")
            for r in rows
        ]
        colors = ["tab:red" if r["order"] == "fcfs" else "tab:blue" for r in rows]
        x = range(len(rows))
        axes[0][col].bar(x, [100 * r["failed_fraction"] for r in rows], color=colors)
        axes[0][col].set_title(f"incast {n}: failed (%)")
        axes[1][col].bar(x, [r["goodput_mib_s"] for r in rows], color=colors)
        axes[1][col].set_title(f"incast {n}: goodput (MiB/s within SLO)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xticks(list(x))
            ax.set_xticklabels(labels, fontsize=7)
    c = result["credits"]
    fig.suptitle(
        "cleave bench incast (red FCFS, blue EDF); credit p99: priority "
        f"{c['priority_p99_us']:.0f} µs vs piggybacked {c['piggyback_p99_us']:.0f} µs"
    )
    return save_figure(fig, path, dpi=100)


def run(args: argparse.Namespace) -> int:
    s = settings(args)
    from cleave.testbed import commands

    reason = commands.unavailable()
    if reason:
        raise UsageError(f"cleave bench incast runs on the testbed: {reason}")
    print(f"cleave bench incast: {len(cases(s))} cases, {s}", file=sys.stderr)
    print(HEADER, file=sys.stderr)
    result, _ = run_bench(s)
    print(table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    target = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if target:
        print(f"plot: {plot(result, target)}", file=sys.stderr)
    return 0
