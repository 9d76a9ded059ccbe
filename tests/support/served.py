"""Reference models served by `cleave serve`: a model, its bundle and its requests with the
model's own scores, and the check that a deployment answers them within TOLERANCE."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
from pathlib import Path

import cleave
import numpy as np
import torch
import torch.utils._pytree as pytree
from cleave.bench.harness.target import bound_grpc_address
from cleave.bench.loadgen import infer_body, outputs_of
from cleave.launch.process import ServeProcess
from cleave.models import MODELS, RequestGenerator

from support.client import closed_loop, post
from support.processes import cli
from support.waiting import wait_for

# Small enough to build in a second or two, large enough to have every kind of feature.
SCALES = {"dlrm": 0.002, "dcn": 0.0005, "din": 0.002, "shared": 0.01}
TOLERANCE = 1e-5


# Where the test session keeps each reference model's bundle, partitioned once for all its
# workers (tests/conftest.py sets it): torch.export of a reference model took 1-1.6 s of CPU,
# and the suite's call sites partitioned the same four models about 30 times (a count of them).
CACHE: Path | None = None


class Served:
    """A model, its bundle and its request generator."""

    def __init__(self, name: str, root: Path):
        self.name = name
        self.model, example = MODELS[name].factory(scale=SCALES[name], seed=0)
        self.model.eval()
        # A copy of the session's: tests may write into theirs.
        self.dir = copy_of(cached_bundle(name, lambda: (self.model, example)), root / name)
        self.bundle = cleave.load_bundle(self.dir)
        self.generator = RequestGenerator(name, scale=SCALES[name], seed=7, min_pooling=0)

    def request(self, batch: int, budget_ms: float | None = None) -> tuple[bytes, list[np.ndarray]]:
        args = self.generator.batch(batch)
        with torch.inference_mode():
            want = [t.double().numpy() for t in pytree.tree_leaves(self.model(*args))]
        return infer_body(self.bundle.named_inputs(*args), budget_ms), want


def cached_bundle(key: str, make) -> Path:
    """The session's bundle under `key` (a reference model's name, or a name for a variant of
    one) of the model `make()` returns with its example inputs: partitioned by the first
    worker that asks, under a lock the workers share (the others wait for it, then read it).
    Read only: serve a `copy_of` it."""
    assert CACHE is not None, "tests/conftest.py's reference_bundles sets support.served.CACHE"
    path = CACHE / key
    with (CACHE / f"{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():  # Bundle.save renames a whole bundle into place
            model, example = make()
            cleave.partition(model.eval(), example).save(path)
    return path


def copy_of(bundle: Path, dest: Path) -> Path:
    return Path(shutil.copytree(bundle, dest))


def reference_bundle(name: str, root: Path) -> Path:
    """A copy, under `root`, of reference model `name`'s bundle (float32, as
    `cleave partition` writes it by default)."""
    make = lambda: MODELS[name].factory(scale=SCALES[name], seed=0)  # noqa: E731
    return copy_of(cached_bundle(name, make), root / name)


def infer_url(server: ServeProcess, served: Served) -> str:
    return f"{server.url}/v2/models/{served.dir.name}/infer"


def check_scores(server: ServeProcess, served: Served, batches=(1, 7, 64)) -> None:
    for batch in batches:
        body, want = served.request(batch)
        status, reply = post(infer_url(server, served), body)
        assert status == 200, reply
        check_outputs(reply, want, (served.name, batch))


def check_outputs(reply: dict, want: list[np.ndarray], what=None) -> None:
    """A KServe reply's outputs equal `want` within TOLERANCE."""
    got = outputs_of(reply)
    assert [g.shape for g in got] == [w.shape for w in want], what
    for g, w in zip(got, want, strict=True):
        assert np.abs(g - w).max() <= TOLERANCE, what


def under_load(server: ServeProcess, served: Served, action) -> list:
    """Runs `action` while three clients send requests; returns every result after checking
    that each answer is exact."""
    requests = [served.request(8) for _ in range(4)]
    results, finish = closed_loop(infer_url(server, served), requests)
    try:
        wait_for(lambda: len(results) > 5, "requests to flow", 30)
        action()
        count = len(results)
        wait_for(lambda: len(results) > count + 5, "requests after the change", 30)
    finally:
        finish()
    for _, _, status, reply, want in results:
        if status == 200:
            check_outputs(reply, want)
    return results


def run_serve(*args: str) -> subprocess.CompletedProcess:
    """`cleave serve ARGS` to its end (bad input: it exits at once)."""
    return subprocess.run(cli("serve", *args), capture_output=True, text=True, timeout=60)


def roomy_budget(tmp_path: Path) -> list[str]:
    """`cleave serve` flags for a 20 s budget and no shedding: for tests of plumbing and
    scores, not latency or admission, which a machine busy with other test workers must still
    pass (docs/testing.md). Admission's adaptive limit follows latency: on such a machine it
    can sink below one request's rows and refuse it (seen: a 64-row dcn request, limit 31)."""
    config = tmp_path / "roomy-budget.toml"
    config.write_text("[router]\nbudget_ms = 20000\nshed = false\n")
    return ["--config", str(config)]


def grpc_target(server: ServeProcess) -> str:
    """The router's gRPC address (`HOST:PORT`) when it was given --grpc-port 0."""
    return bound_grpc_address(list(server.log))
