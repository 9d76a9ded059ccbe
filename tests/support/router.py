"""A router (the `cleave-router` executable) in front of two embedding shards (`cleave shard`,
each holding half of every table's rows) and a ranker (`cleave ranker`), serving the `shared`
reference model; each process binds port 0 and says its address on its ready line. And the
KServe JSON requests the router tests send it."""

from __future__ import annotations

import json
from pathlib import Path

import cleave
import torch
import torch.utils._pytree as pytree
from cleave.launch.supervisor import find_executable
from cleave.models import MODELS, RequestGenerator

from support.processes import Process, cli

MODEL, SCALE = "shared", 0.01
BODY_LIMIT = 256 << 10
KSERVE = {
    torch.float32: "FP32",
    torch.float16: "FP16",
    torch.int64: "INT64",
    torch.int32: "INT32",
    torch.uint8: "UINT8",
    torch.bool: "BOOL",
}


def whole_tables(manifest: dict, addr: str) -> list[dict]:
    """A router config's `shards`: every table of `manifest`, all its rows, at one shard."""
    return [
        {"table": t["name"], "row_start": 0, "row_end": int(t["rows"]), "addr": addr}
        for t in manifest["tables"]
    ]


def started(name: str, argv: list[str]) -> Process:
    """A role process, once its ready line (with the address it bound) is out."""
    return Process(argv, name=name).wait_ready_line()


class Deployment:
    def __init__(self, root: Path):
        self.model, example = MODELS[MODEL].factory(scale=SCALE, seed=0)
        self.model.eval()
        self.bundle = cleave.partition(self.model, example)
        self.dir = self.bundle.save(root / "bundle")
        self.manifest = self.bundle.manifest
        self.children: list[Process] = []
        routes = []
        halves = [{}, {}]
        for t in self.manifest["tables"]:
            rows = int(t["rows"])
            halves[0][t["name"]] = (0, rows // 2)
            halves[1][t["name"]] = (rows // 2, rows)
        for i, half in enumerate(halves):
            rows = ",".join(f"{name}={a}:{b}" for name, (a, b) in half.items())
            shard = self._start(
                f"shard-{i}",
                cli("shard", "--bundle", str(self.dir), "--listen", "127.0.0.1:0", "--rows", rows),
            )
            routes += [
                {"table": name, "row_start": a, "row_end": b, "addr": shard.address}
                for name, (a, b) in half.items()
            ]
        ranker = self._start(
            "ranker",
            cli("ranker", "--bundle", str(self.dir), "--listen", "127.0.0.1:0", "--threads", "1"),
        )
        config = {
            "model": MODEL,
            "bundle": str(self.dir),
            "http_port": 0,
            "shards": routes,
            "rankers": [ranker.address],
            "budget_ms": 20000,
            "body_limit_bytes": BODY_LIMIT,
            "threads": 1,
        }
        path = root / "router.json"
        path.write_text(json.dumps(config))
        self.router = self._start("router", [find_executable("cleave-router"), str(path)])
        self.url = f"{self.router.address}/v2/models/{MODEL}"

    def _start(self, name: str, argv: list[str]) -> Process:
        try:
            child = started(name, argv)
        except AssertionError:
            self.stop()
            raise
        self.children.append(child)
        return child

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()


def good_request(deployment, batch: int = 4, seed: int = 3):
    """A KServe body for `batch` generated candidates, and the model's own scores for them."""
    gen = RequestGenerator(MODEL, scale=SCALE, seed=seed, min_pooling=1)
    args = gen.batch(batch)
    named = deployment.bundle.named_inputs(*args)
    body = {
        "inputs": [
            {
                "name": name,
                "datatype": KSERVE[t.dtype],
                "shape": list(t.shape),
                "data": t.flatten().tolist(),
            }
            for name, t in named.items()
        ]
    }
    with torch.inference_mode():
        want = [t.double() for t in pytree.tree_leaves(deployment.model(*args))]
    return body, want
