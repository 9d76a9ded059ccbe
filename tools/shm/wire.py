"""The wire alone, Unix sockets against shared memory (docs/benchmarks.md, "Pass-by-reference
between co-located roles"): one process, `FrameClient` calling a `FrameServer` (the Python
ranker's server: `recv` hands each payload over as `bytes` on unix, in place over the slot on
shm) with a RANK-sized request and a
2-byte reply; alternating rounds of each transport. Prints a table and JSON with the ratios
shm over unix of the median round trip and of the process's CPU per call.

    .venv/bin/python tools/shm/wire.py [--bytes 3500000] [--calls 300] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time

from cleave._native import FrameClient, FrameServer

KIND = 0x0101


def measure(address: str, payload: bytes, calls: int) -> dict:
    server = FrameServer(address)
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            for conn, request_id, kind, _payload, _deadline, _trace in server.recv(64, 0.05):
                server.reply(conn, request_id, kind, b"ok")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        client = FrameClient(server.address, 5.0, 1)
        for _ in range(20):  # connections, regions and pages warmed up
            client.call(KIND, payload)
        rtt = []
        cpu0 = time.process_time()
        for _ in range(calls):
            t0 = time.perf_counter()
            client.call(KIND, payload)
            rtt.append(time.perf_counter() - t0)
        cpu = (time.process_time() - cpu0) / calls
    finally:
        stop.set()
        thread.join()
        server.close()
    return {"rtt_p50_ms": statistics.median(rtt) * 1e3, "cpu_ms_per_call": cpu * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, default=3_500_000, help="request payload size")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    payload = os.urandom(args.bytes)
    rows: dict[str, list[dict]] = {"unix": [], "shm": []}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            for transport in rows:
                address = f"{transport}:{d}/{transport}-{r}.sock"
                rows[transport].append(measure(address, payload, args.calls))
    print(f"{'transport':<10} {'round':>5} {'rtt p50 ms':>11} {'CPU ms/call':>12}")
    for transport, results in rows.items():
        for i, m in enumerate(results):
            print(f"{transport:<10} {i:>5} {m['rtt_p50_ms']:>11.3f} {m['cpu_ms_per_call']:>12.3f}")

    def mean(transport: str, key: str) -> float:
        return statistics.mean(m[key] for m in rows[transport])

    ratios = {
        f"{key}_shm_over_unix": mean("shm", key) / mean("unix", key)
        for key in ("rtt_p50_ms", "cpu_ms_per_call")
    }
    print(json.dumps({"bytes": args.bytes, "calls": args.calls, "runs": rows, "ratios": ratios}))


if __name__ == "__main__":
    main()
