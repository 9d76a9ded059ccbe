"""`cleave bench refusal`: what the router spends refusing a request, by body size.

One deployment (`cleave serve`, one shard, one ranker) whose router lets one request in at a
time (`max_in_flight = 1`): one request is held in flight, its body half sent, so every other
is refused 503 at the door before its body is parsed (docs/api.md, "Admission control and load
shedding"). For each --candidates size, --count refusals go one after another, and the
router's CPU (every thread's schedstat) and the client's wall time per refusal are measured two
ways, alternating, in the same run:

* `keep-alive`: the next request on the same connection, which the router keeps where it
  reads and drops the refused body (up to 2 MiB);
* `close`: the client asks for `Connection: close` and opens a new connection for its next
  request: what every refusal of a body over 64 KiB cost while the router closed those
  connections, and what a client that does not keep connections alive pays.

Ratios keep-alive over close, per size. Server and client are pinned apart (--pin). The
client is this module's own few lines over a socket, not the load generator: what is measured
is which connection each request goes on, which a load generator leaves to itself.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

from cleave.bench.stages import gauge
from cleave.errors import UsageError

MODES = ("keep-alive", "close")
HOLD_S = 60  # the held request's budget and body grace: longer than any run
IO_TIMEOUT_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="dlrm", help="a reference model (cleave.models)")
    parser.add_argument("--scale", type=float, default=0.05, help="the model's table scale")
    parser.add_argument(
        "--candidates", default="100,256,2048", help="request sizes, comma-separated"
    )
    parser.add_argument("--count", type=int, default=300, help="refusals per size and mode")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians kept")
    parser.add_argument("--pin", default="auto", help="SERVER:CLIENT CPU lists, auto or off")
    parser.add_argument("--quick", action="store_true", help="a short run (tests)")
    parser.add_argument("--workdir", help="keep the bundle and config here (default: a temp dir)")
    parser.add_argument("--json", help="write the results here")


def run(args: argparse.Namespace) -> int:
    from cleave.bench.harness.command import counts, in_workdir, report
    from cleave.bench.machine import describe, parse_pin

    if args.quick:  # the shape of a run, not a measurement
        args.scale, args.count, args.rounds = 0.01, 20, 1
    sizes = counts(args.candidates, "--candidates")
    if args.count < 1 or args.rounds < 1:
        raise UsageError(
            f"--count and --rounds must be at least 1, got {args.count}, {args.rounds}"
        )
    pins = parse_pin(args.pin)
    result = in_workdir(args, "refusal", lambda workdir: measure(workdir, args, sizes, pins))
    result["machine"] = describe()
    report(result, args, print_table)
    return 0


def measure(workdir: Path, args, sizes: list[int], pins) -> dict:
    import torch

    import cleave
    from cleave.bench.harness.processes import role_pid
    from cleave.bench.loadgen import infer_body
    from cleave.bench.machine import pinned
    from cleave.launch.process import ServeProcess
    from cleave.models import MODELS, RequestGenerator

    model, example = MODELS[args.model].factory(scale=args.scale, seed=0)
    partitioned = cleave.partition(model.eval(), example)
    bundle = partitioned.save(workdir / args.model)
    generator = RequestGenerator(args.model, scale=args.scale, seed=7)
    with torch.inference_mode():
        bodies = {n: infer_body(partitioned.named_inputs(*generator.batch(n))) for n in sizes}
    toml = workdir / "router.toml"
    toml.write_text(
        f"[router]\nmax_in_flight = 1\nbudget_ms = {HOLD_S * 1000}\n"
        f"body_grace_ms = {HOLD_S * 1000}\n"
    )
    server_cpus, client_cpus = pins
    with pinned(server_cpus):
        server = ServeProcess(bundle, "--shards", "1", "--config", str(toml)).start()
    try:
        router = role_pid(server.proc.pid, "router")
        if router is None:
            raise RuntimeError("the deployment has no router process")
        address = _address(server.url)
        path = f"/v2/models/{bundle.name}/infer"
        runs: dict = {(n, m): [] for n in sizes for m in MODES}
        with pinned(client_cpus), _Held(address, path, bodies[sizes[0]], server.url):
            for i in range(args.rounds):
                for n in sizes:
                    for mode in MODES if i % 2 == 0 else MODES[::-1]:
                        runs[(n, mode)].append(
                            _refusals(address, path, bodies[n], mode, args.count, router)
                        )
    finally:
        server.stop()
    return _summary(args, sizes, bodies, runs)


def _address(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].rstrip("/").rsplit(":", 1)
    return host.strip("[]"), int(port)


def _head(path: str, length: int, close: bool) -> bytes:
    extra = "connection: close\r\n" if close else ""
    return (
        f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n{extra}\r\n"
    ).encode()


class _Held:
    """One request admitted and kept in flight, its body half sent, for the block."""

    def __init__(self, address, path: str, body: bytes, url: str):
        self.address, self.path, self.body, self.url = address, path, body, url

    def __enter__(self):
        self.sock = socket.create_connection(self.address, timeout=IO_TIMEOUT_S)
        self.sock.sendall(_head(self.path, len(self.body), False) + self.body[:10])
        deadline = time.monotonic() + IO_TIMEOUT_S
        while gauge(f"{self.url}/metrics", "cleave_router_in_flight") != 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the held request was not admitted")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.sock.close()


def _refusals(address, path: str, body: bytes, mode: str, count: int, router: int) -> dict:
    """`count` refused requests in a row; the router's CPU and the wall time per refusal."""
    from cleave.bench.harness.processes import cpu_ns

    close = mode == "close"
    request = _head(path, len(body), close) + body
    sock, connections = socket.create_connection(address, timeout=IO_TIMEOUT_S), 1
    cpu, start = cpu_ns(router), time.perf_counter()
    try:
        for _ in range(count):
            sock.sendall(request)
            status, closing = _response(sock)
            if status != 503:
                raise RuntimeError(f"expected every request refused (503), got {status}")
            if close or closing:
                while sock.recv(1 << 16):  # the router's orderly end of stream
                    pass
                sock.close()
                sock = socket.create_connection(address, timeout=IO_TIMEOUT_S)
                connections += 1
    finally:
        sock.close()
    wall, spent = time.perf_counter() - start, cpu_ns(router) - cpu
    return {
        "router_cpu_us": spent / count / 1e3,
        "wall_us": wall / count * 1e6,
        "connections": connections,
    }


def _response(sock: socket.socket) -> tuple[int, bool]:
    """Reads one response; its status and whether the router closes the connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise RuntimeError("the router closed the connection before answering")
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    length = int(headers.get("content-length", 0))
    while len(rest) < length:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        rest += chunk
    return int(lines[0].split()[1]), headers.get("connection") == "close"


def _summary(args, sizes: list[int], bodies: dict, runs: dict) -> dict:
    import statistics

    def median(n: int, mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[(n, mode)])

    cases = []
    for n in sizes:
        row = {"candidates": n, "body_bytes": len(bodies[n])}
        for mode in MODES:
            row[mode] = {
                "router_cpu_us": round(median(n, mode, "router_cpu_us"), 1),
                "wall_us": round(median(n, mode, "wall_us"), 1),
                "connections": runs[(n, mode)][0]["connections"],
                "rounds": runs[(n, mode)],
            }
        keep, close = row["keep-alive"], row["close"]
        row["router_cpu_keepalive_over_close"] = round(
            keep["router_cpu_us"] / close["router_cpu_us"], 3
        )
        row["wall_keepalive_over_close"] = round(keep["wall_us"] / close["wall_us"], 3)
        cases.append(row)
    return {
        "bench": "refusal",
        "model": args.model,
        "scale": args.scale,
        "count": args.count,
        "rounds": args.rounds,
        "cases": cases,
    }


def print_table(result: dict) -> None:
    print(
        f"router CPU and client wall time per refused request, medians of {result['rounds']} "
        f"alternating rounds of {result['count']}"
    )
    print(
        f"{'candidates':>10} {'body KiB':>8} {'mode':>10} {'CPU us':>8} {'wall us':>8} {'conns':>6}"
    )
    for case in result["cases"]:
        for mode in MODES:
            m = case[mode]
            print(
                f"{case['candidates']:10} {case['body_bytes'] / 1024:8.1f} {mode:>10} "
                f"{m['router_cpu_us']:8.1f} {m['wall_us']:8.1f} {m['connections']:6}"
            )
        print(
            f"{'':>10} keep-alive / close: CPU {case['router_cpu_keepalive_over_close']:.2f}, "
            f"wall {case['wall_keepalive_over_close']:.2f}"
        )
    sys.stdout.flush()
