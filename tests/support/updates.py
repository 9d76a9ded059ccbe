"""Row updates on a served plan (docs/updates.md): a plan whose shards keep state, requests
that keep arriving across an update, and `cleave update` run against the deployment."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from cleave.bench.loadgen import outputs_of
from cleave.plan.files import load_plan, save_plan

from support.client import post
from support.waiting import wait_for

MAX_REQUESTS = 20_000  # a background load's bound, beside its 60 s


def scores(url: str, bodies) -> list[bytes]:
    """Each body's scores as bytes (bit-for-bit comparable); every request must answer 200."""
    replies = [post(url, b) for b in bodies]
    assert all(s == 200 for s, _ in replies), replies
    return [score_bytes(r) for _, r in replies]


def score_bytes(reply: dict) -> bytes:
    return b"".join(o.tobytes() for o in outputs_of(reply))


def updatable_plan(bundle: Path, path: Path, shards: int = 2, replicas: int = 1):
    """`cleave plan BUNDLE` on 4 hosts, its shards keeping state (so they take updates), one
    lookup thread each and every port free (other tests may hold the plan's): (path, plan)."""
    done = subprocess.run(
        [sys.executable, "-m", "cleave.cli", "plan", str(bundle), "--hosts", "4"]
        + ["--shards", str(shards), "--replicas", str(replicas), "-o", str(path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    plan = load_plan(path)
    for shard in plan.shards:
        shard.state_dir = f"state/{shard.name}"
        shard.threads = 1
    for role in [*plan.shards, *plan.rankers]:
        role.port = role.metrics_port = 0
    for router in plan.routers:
        router.http_port = 0
    save_plan(plan, path)
    return path, plan


class Load:
    """Requests sent one after another in a thread until the block ends (at most 60 s or
    MAX_REQUESTS): `sent` holds (time sent, status, reply) per request, in order."""

    def __init__(self, url: str, bodies: list[bytes]):
        self.url, self.bodies = url, bodies
        self.sent: list[tuple[float, int, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        deadline = time.monotonic() + 60
        while not self._stop.is_set() and time.monotonic() < deadline:
            if len(self.sent) >= MAX_REQUESTS:
                break
            at = time.time()
            status, reply = post(self.url, self.bodies[len(self.sent) % len(self.bodies)])
            self.sent.append((at, status, reply))

    def more(self, count: int) -> None:
        """Waits until `count` more requests were answered (or the load ended)."""
        now = len(self.sent)
        wait_for(
            lambda: len(self.sent) >= now + count or not self._thread.is_alive(),
            f"{count} more requests answered",
        )

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_update(plan: Path, table: str, rows: Path, router: str, *flags: str):
    """`cleave update --plan PLAN --table T --rows R --router URL FLAGS` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "cleave.cli", "update", "--plan", str(plan)]
        + ["--table", table, "--rows", str(rows), "--router", router, *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
