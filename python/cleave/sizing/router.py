"""The router's CPU per request, measured for `cleave profile`: the bundle served on this
machine (one shard, one ranker, TCP over loopback), binary-tensor requests of the profile's shape
synthesized from the manifest's inputs, sent one at a time; the router process's CPU time
over the requests answered. A bundle whose inputs this cannot synthesize (a TorchRec KJT, a
symbolic size it cannot resolve) is not measured: `cleave size` then estimates (search.py)."""

from __future__ import annotations

import http.client
import re
import time
import urllib.parse
from pathlib import Path

import numpy as np

WARM_UP = 5
# Each request's budget: the router's largest by default (router.max_budget_ms). A request is
# timed however long it takes: under the 1 s default, one slow request on a starved core was
# answered 504, which ended the profile.
BUDGET_MS = 60_000.0
MIN_REQUESTS, MAX_REQUESTS = 50, 20_000


class Unsupported(Exception):
    """The manifest's inputs are of a kind `synthetic_inputs` does not build."""


def synthetic_inputs(manifest: dict, candidates: int, ids_per_candidate: float, rng) -> dict:
    """Manifest-named tensors of one request: `candidates` rows, `ids_per_candidate` ids per
    bag (offsets, lengths and KeyedJaggedTensor layouts), ids uniform over each table's rows,
    dense inputs from a standard normal, weights 1. Inputs outside the batch (a user's history:
    `[1, N]`) get `ids_per_candidate * candidates` ids."""
    import torch

    k = max(1, round(ids_per_candidate))
    specs = {i["name"]: i for i in manifest["inputs"]}
    tables = {t["name"]: int(t["rows"]) for t in manifest["tables"]}
    sizes: dict[str, int] = {"B": candidates}
    named = {}
    for kjt in manifest.get("kjts", []):
        named.update(_kjt(kjt, manifest, specs, tables, sizes, k, rng))
    rows_of: dict[str, int] = {}
    for f in manifest["features"]:
        if f.get("layout") == "kjt":
            continue
        rows_of[f["ids"]] = tables[f["table"]]
        bag_input = f.get("offsets") or f.get("lengths")
        if bag_input:
            bags = _resolve(specs[bag_input]["shape"][0], sizes)
            symbol = specs[f["ids"]]["shape"][0]
            if isinstance(symbol, str):
                sizes.setdefault(symbol, bags * k)
    for name, spec in specs.items():
        if name in named:
            continue
        shape = [_resolve(d, sizes, default=k * candidates) for d in spec["shape"]]
        role, dtype = spec["role"], getattr(torch, spec["dtype"])
        if role in ("ids", "both"):
            high = rows_of.get(name, 1)
            named[name] = torch.from_numpy(rng.integers(0, high, size=shape)).to(dtype)
        elif role == "offsets":
            bags = shape[0]
            step = _ids_len(manifest, name, sizes, specs) // max(1, bags)
            named[name] = torch.arange(bags, dtype=dtype) * step
        elif role == "lengths":
            step = _ids_len(manifest, name, sizes, specs) // max(1, shape[0])
            named[name] = torch.full(shape, step, dtype=dtype)
        elif role == "weights":
            named[name] = torch.ones(shape, dtype=dtype)
        elif role == "dense":
            named[name] = torch.from_numpy(rng.standard_normal(shape)).to(dtype)
        else:  # unused
            named[name] = torch.zeros(shape, dtype=dtype)
    return {spec["name"]: named[spec["name"]] for spec in manifest["inputs"]}


def _kjt(kjt: dict, manifest: dict, specs: dict, tables: dict, sizes: dict, k: int, rng) -> dict:
    """A KeyedJaggedTensor's inputs: `lengths` (keys x bags, key-major, k each), `values`
    (each key's ids over its table's rows, in key order), `weights` (1) when it has them."""
    import torch

    table_of = {
        f["key"]: f["table"]
        for f in manifest["features"]
        if f.get("layout") == "kjt" and f.get("kjt") == kjt["name"]
    }
    keys = kjt["keys"]
    if set(keys) - set(table_of):
        raise Unsupported(f"KJT {kjt['name']!r} keys without a table: {set(keys) - set(table_of)}")
    lengths = specs[kjt["lengths"]]
    count = _resolve(lengths["shape"][0], sizes)
    bags = count // len(keys)
    values = np.concatenate([rng.integers(0, tables[table_of[key]], bags * k) for key in keys])
    out = {
        kjt["lengths"]: torch.full((count,), k, dtype=getattr(torch, lengths["dtype"])),
        kjt["values"]: torch.from_numpy(values).to(getattr(torch, specs[kjt["values"]]["dtype"])),
    }
    if kjt.get("weights"):
        dtype = getattr(torch, specs[kjt["weights"]]["dtype"])
        out[kjt["weights"]] = torch.ones(len(values), dtype=dtype)
    return out


def _resolve(dim, sizes: dict[str, int], default: int | None = None) -> int:
    """A manifest dimension: a number, a symbol (`B`, `N0`) or an expression of them (`26*B`,
    `B+1`); an unknown symbol gets `default`, or raises Unsupported without one."""
    if isinstance(dim, int):
        return dim
    if dim in sizes:
        return sizes[dim]
    if re.fullmatch(r"[A-Za-z_]\w*", dim):
        if default is None:
            raise Unsupported(f"the size {dim!r}")
        sizes[dim] = default
        return default
    known = re.sub(r"[A-Za-z_]\w*", lambda m: str(sizes.get(m.group(), "?")), dim)
    if not re.fullmatch(r"[0-9+*() -]+", known):
        raise Unsupported(f"the size {dim!r}")
    # Only digits and + * ( ) - remain: arithmetic, nothing else to evaluate.
    return int(eval(known, {"__builtins__": {}}))


def _ids_len(manifest, bag_input: str, sizes, specs) -> int:
    """How many ids the feature whose bags `bag_input` describes has."""
    for f in manifest["features"]:
        if bag_input in (f.get("offsets"), f.get("lengths")):
            return _resolve(specs[f["ids"]]["shape"][0], sizes)
    raise Unsupported(f"offsets {bag_input!r} of no feature")


def measure_router(bundle_dir: Path, named: dict, seconds: float) -> dict:
    """Serves the bundle and sends `named` as a binary-tensor request, one at a time."""
    from cleave.bench.harness.processes import cpu_ns, role_pid
    from cleave.bench.loadgen import binary_infer_body
    from cleave.launch.process import ServeProcess

    body = binary_infer_body(named, BUDGET_MS)
    # Over TCP, as the plans `cleave size` writes are served: on the testbed the router and
    # the rankers spent 2-3 ns per byte more over TCP than the Unix-socket profile had timed
    # (docs/sizing.md, "Validation").
    flags = ["--shards", "1", "--rankers", "1", "--threads", "1", "--transport", "tcp"]
    server = ServeProcess(bundle_dir, *flags).start()
    try:
        url = urllib.parse.urlsplit(server.url)
        path = f"/v2/models/{Path(bundle_dir).resolve().name}/infer"
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        for _ in range(WARM_UP):
            _send(conn, path, body)
        router = role_pid(server.proc.pid, "router")
        # The ranker's CPU too: its whole process's per request (decoding, the dense
        # program, encoding), which `cleave size` sets against the dense program's own time.
        ranker = role_pid(server.proc.pid, "ranker")
        ranker_before = cpu_ns(ranker) if ranker else 0
        before, start, latencies = cpu_ns(router), time.perf_counter(), []
        while (time.perf_counter() - start < seconds or len(latencies) < MIN_REQUESTS) and len(
            latencies
        ) < MAX_REQUESTS:
            t0 = time.perf_counter()
            _send(conn, path, body)
            latencies.append(time.perf_counter() - t0)
        cpu = (cpu_ns(router) - before) / 1e9
        ranker_cpu = (cpu_ns(ranker) - ranker_before) / 1e9 if ranker else None
        conn.close()
    finally:
        server.stop()
    return {
        "cpu_us_per_request": round(cpu / len(latencies) * 1e6, 1),
        "p50_ms": round(float(np.median(latencies)) * 1e3, 3),
        "requests": len(latencies),
        "request_bytes": len(body),
        **(
            {"ranker_cpu_us_per_request": round(ranker_cpu / len(latencies) * 1e6, 1)}
            if ranker_cpu is not None
            else {}
        ),
    }


def _send(conn: http.client.HTTPConnection, path: str, body) -> None:
    conn.request("POST", path, body=bytes(body), headers=body.headers)
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise RuntimeError(f"the served bundle answered {response.status}: {data[:300]!r}")
