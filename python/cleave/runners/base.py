"""The runner interface (docs/plan.md, "Runners"): something that executes a deployment plan.
Local processes, the emulated testbed and Ray implement it (Kubernetes runs a plan through the
Helm chart instead, docs/deploy.md); keep it small."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cleave.plan import Plan


class Runner(ABC):
    """Executes one plan, once: start() -> watch() -> stop(). Not reusable after stop()."""

    @abstractmethod
    def start(self, plan: Plan, plan_dir: Path) -> list[str]:
        """Called once, first, with a plan already checked against its bundle. Binds real
        addresses, starts every role (shards and rankers, then routers) and returns once each
        is ready: the routers' client URLs, one per router in plan order. `plan_dir` is a
        private directory of this deployment for the runner's files (router JSON, Unix
        sockets); the caller made it and removes it after stop(). On failure it has already
        stopped whatever it started and raises (ChildFailed, or UsageError for bad input)."""

    @abstractmethod
    def watch(self) -> int:
        """Called after start(), blocks until request_stop(): 0 then. A role that dies is
        restarted with the supervisor's backoff while the others keep serving, unless the
        plan's `supervision.fail_stop`: then it returns 1 at the first death."""

    @abstractmethod
    def request_stop(self) -> None:
        """Called from a signal handler or another thread: makes start() give up and watch()
        return soon. Stops nothing itself."""

    @abstractmethod
    def stop(self) -> dict[str, int]:
        """Called last, always (also after a failed start()); idempotent. Stops every role
        (routers first, SIGKILL after the plan's stop timeout) and removes what the runner
        made (a testbed, say). Returns each role's exit code by name."""
