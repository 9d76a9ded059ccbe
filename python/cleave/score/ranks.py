"""The ranks of a `cleave score` job: their process group (torch.distributed over gloo) and
the rank processes `cleave score --ranks N` starts and watches."""

from __future__ import annotations

import datetime
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from cleave.errors import CleaveError

__all__ = ["RankFailed", "RankGroup", "init_group", "leave_group"]

EVENT = "score "  # a rank's report lines on stdout start with this, then JSON


class RankFailed(CleaveError):
    """A rank died or reported an error; the message names it and the batch."""


def init_group(rank: int, world: int, store: Path | None, startup_s: float) -> None:
    """Joins the job's gloo process group: through a FileStore at `store` (ranks on one
    machine: no port to pick), else torchrun's rendezvous (env://). `startup_s` bounds the
    group's own collectives (start-up, the barriers); point-to-point waits carry the
    collective's short timeout."""
    import torch.distributed as dist

    if world == 1:
        return
    timeout = datetime.timedelta(seconds=startup_s)
    if store is not None:
        file_store = dist.FileStore(str(store), world)
        dist.init_process_group(
            "gloo", store=file_store, rank=rank, world_size=world, timeout=timeout
        )
    else:
        dist.init_process_group(
            "gloo", init_method="env://", rank=rank, world_size=world, timeout=timeout
        )


def leave_group() -> None:
    """Leaves the job's process group after a collective every rank took part in (so no
    peer still waits on this one). A torchrun rank that exited with the group alive aborted
    at interpreter exit ("terminate called without an active exception": gloo's threads
    still joinable), twice in the test suite's runs, after every row was written."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def report(kind: str, **fields) -> None:
    """One report line to the launcher (a rank's stdout)."""
    print(EVENT + json.dumps({"event": kind, **fields}), flush=True)


@dataclass
class RankState:
    pid: int
    working_on: int  # the global batch it is on
    error: str = ""
    stats: dict = field(default_factory=dict)


class RankGroup:
    """A job's rank processes on this machine (`python -m cleave.score.pipeline`), each
    reporting on its stdout; `watch` follows them to the end."""

    def __init__(self, job, store: Path):
        world = job.ranks
        env = {**os.environ, "OMP_NUM_THREADS": str(job.threads)}
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: loopback, whatever the name
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "cleave.score.pipeline",
                    str(job.work / "job.json"),
                    "--rank",
                    str(r),
                    "--world",
                    str(world),
                    "--store",
                    str(store),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                start_new_session=True,
            )
            for r in range(world)
        ]
        self.states = [RankState(p.pid, job.batch(r, job.start)) for r, p in enumerate(self.procs)]
        self.events: queue.Queue = queue.Queue()
        self.stderr: list[list[str]] = [[] for _ in self.procs]
        for r, p in enumerate(self.procs):
            threading.Thread(target=self._read, args=(r, p), daemon=True).start()
            threading.Thread(target=self._drain, args=(r, p), daemon=True).start()

    def _read(self, rank: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            if line.startswith(EVENT):
                self.events.put((rank, json.loads(line[len(EVENT) :])))
        proc.wait()
        self.events.put((rank, {"event": "exit", "code": proc.returncode}))

    def _drain(self, rank: int, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            self.stderr[rank].append(line.rstrip("\n"))
            del self.stderr[rank][:-40]

    def watch(self, on_event, grace_s: float) -> None:
        """Follows the ranks until all exit; `on_event(rank, event)` sees every report. The
        first rank to fail fails the job (RankFailed naming it and its batch) once the others
        noticed (they fail within the collective's timeout) or `grace_s` passed."""
        running = set(range(len(self.procs)))
        failed: list[tuple[int, str]] = []
        deadline = None
        while running:
            try:
                rank, event = self.events.get(timeout=0.5 if deadline else None)
            except queue.Empty:
                if time.monotonic() > deadline:
                    self.stop()
                continue
            state = self.states[rank]
            kind = event["event"]
            if kind == "batch":
                state.working_on = event["next"]
            elif kind == "error":
                state.error = event["message"]
            elif kind == "done":
                state.stats = event["stats"]
            elif kind == "exit":
                running.discard(rank)
                if event["code"] != 0:
                    failed.append((rank, self._why(rank, event["code"])))
                    deadline = deadline or time.monotonic() + grace_s
            on_event(rank, event)
        if failed:
            raise RankFailed(self._failure(failed))

    def _why(self, rank: int, code: int) -> str:
        state = self.states[rank]
        if code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        elif state.error:
            how = f"failed: {state.error}"
        else:
            tail = "\n".join(self.stderr[rank][-15:])
            how = f"exited with code {code}:\n{tail}"
        return f"rank {rank} (pid {state.pid}) during batch {state.working_on} {how}"

    def _failure(self, failed: list[tuple[int, str]]) -> str:
        # The first to fail is the cause: the others failed because it did (they name it).
        first = min(failed, key=lambda f: (not self._killed(f[0]), failed.index(f)))
        others = [why for r, why in failed if r != first[0]]
        text = first[1]
        if others:
            text += "\nthen: " + "\nthen: ".join(others)
        return text

    def _killed(self, rank: int) -> bool:
        return (self.procs[rank].returncode or 0) < 0

    def stop(self) -> None:
        """SIGKILL to every rank still running (each its own process group)."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
