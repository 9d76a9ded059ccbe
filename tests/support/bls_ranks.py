"""One rank of tests/test_score_collective.py: `python bls_ranks.py RANK WORLD DIR` joins a gloo
group through a FileStore in DIR and runs the collective's scenarios in order, printing one
JSON line per finding; the last rank kills itself at the end and the others report how their
wait failed. `run_ranks(tmp_path, world)` starts them and returns each rank's findings."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LAG = 2
ITERATIONS = 9


def payload(sender: int, receiver: int, iteration: int):
    """What `sender` sends `receiver` in `iteration`: its length varies, its values say who
    and when."""
    import torch

    n = 1 + 7 * ((sender + 2 * receiver + iteration) % 5) + 30 * (iteration % 3)
    return torch.full((n,), 1000 * sender + 100 * receiver + iteration, dtype=torch.int64)


def main(rank: int, world: int, where: Path) -> None:
    import torch
    import torch.distributed as dist
    from cleave.score.collective import BoundedLagAlltoallv, CollectiveError, PeerError

    def say(**finding):
        print(json.dumps({"rank": rank, **finding}), flush=True)

    store = dist.FileStore(str(where / "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    signals = dist.FileStore(str(where / "signals"), world)

    # 1. Lag and order: rank 0 starts LAG + 1 iterations before any peer starts one (they
    # wait for its signal), so a start never waits for a peer. Sizes vary and outgrow the
    # capacity; every message is checked, in order.
    bls = BoundedLagAlltoallv(LAG, torch.int64, tag=0, capacity=8)
    checked = []

    def finish(j):
        got = bls.wait(j, expect=[len(payload(p, rank, j)) for p in range(world)])
        checked.append(all(torch.equal(got[p], payload(p, rank, j)) for p in range(world)))

    first = 0
    if rank == 0:
        for i in range(LAG + 1):
            bls.start(i, [payload(rank, p, i) for p in range(world)])
        signals.set("ahead", "1")
        say(scenario="lag", ahead=bls.unfinished)
        first = LAG + 1
    else:
        signals.wait(["ahead"])
    listing2(bls, first, lambda i: [payload(rank, p, i) for p in range(world)], finish)
    say(scenario="order", checked=len(checked), all_equal=all(checked))

    # 2. Buffer reuse: with sizes within capacity, each slot receives into one buffer per peer.
    fixed = BoundedLagAlltoallv(LAG, torch.int64, tag=1)
    storages: dict[int, set] = {}

    def keep(j):
        got = fixed.wait(j)
        for p in range(world):
            if p != rank:
                storages.setdefault(fixed.slot(j), set()).add(got[p].untyped_storage().data_ptr())

    listing2(fixed, 0, lambda i: [torch.full((5,), i)] * world, keep)
    say(scenario="reuse", slots=len(storages), per_slot=sorted({len(s) for s in storages.values()}))

    # 3. Synchronous (lag 0): each rank sends 3 + its rank elements, each expects 3 + its own.
    sync = BoundedLagAlltoallv(0, torch.float32, tag=2)
    sync.start(0, [torch.ones(3 + rank)] * world)
    try:
        sync.wait(0, expect=[3 + rank] * world)
        say(scenario="mismatch", error=None)
    except CollectiveError as err:
        say(scenario="mismatch", error=str(err))

    # 4. A peer that stops answering (the last rank starts nothing): a timeout naming it. A
    # timeout closes the group's connections, so this one runs in a group of its own.
    group = dist.new_group(list(range(world)))
    silent = BoundedLagAlltoallv(0, torch.uint8, timeout_s=1.0, group=group)
    if rank != world - 1:
        silent.start(0, [torch.zeros(1, dtype=torch.uint8)] * world)
        try:
            silent.wait(0)
        except PeerError as err:
            say(scenario="silent", peer=err.peer, error=str(err))
        signals.set(f"silent-{rank}", "1")

    # 5. A peer that dies: the last rank kills itself once the others are past scenario 4.
    dead = BoundedLagAlltoallv(1, torch.uint8, tag=3)
    if rank == world - 1:
        signals.wait([f"silent-{r}" for r in range(world - 1)], datetime.timedelta(seconds=60))
        os.kill(os.getpid(), signal.SIGKILL)
    dead.start(0, [torch.zeros(4, dtype=torch.uint8)] * world)
    began = time.monotonic()
    try:
        dead.wait(0)
        say(scenario="dead", error=None)
    except PeerError as err:
        say(scenario="dead", peer=err.peer, error=str(err), after_s=time.monotonic() - began)


def listing2(bls, first: int, sends, finish) -> None:
    """BLS Listing 2: start each iteration, finish the oldest once more than the lag are
    unfinished, drain at the end."""
    for i in range(first, ITERATIONS):
        if bls.unfinished > bls.lag:
            finish(i - bls.lag - 1)
        bls.start(i, sends(i))
    while bls.unfinished:
        finish(ITERATIONS - bls.unfinished)


def run_ranks(tmp_path: Path, world: int) -> dict[int, dict[str, dict]]:
    """Starts `world` ranks and returns, per rank, its findings by scenario."""
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), str(world), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
        )
        for r in range(world)
    ]
    found: dict[int, dict[str, dict]] = {}
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=180)
        found[r] = {f["scenario"]: f for f in map(json.loads, out.splitlines())}
        found[r]["exit"] = {"code": p.returncode, "stderr": err[-2000:]}
    return found


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
