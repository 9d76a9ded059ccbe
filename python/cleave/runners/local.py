"""The local runner: every role of a plan is a process on this machine, whatever logical host
the plan puts it on (docs/plan.md, "Runners")."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from cleave.runners.roles import Binding
from cleave.runners.supervised import SupervisedRunner

if TYPE_CHECKING:
    from cleave.plan import Plan, Ranker, Router, Shard

LOOPBACK = "127.0.0.1"


def _ports(plan: Plan) -> list[int]:
    """Every non-zero port the plan names, all hosts together."""
    ports = [p for r in [*plan.shards, *plan.rankers] for p in (r.port, r.metrics_port)]
    return [p for p in ports + [r.http_port for r in plan.routers] if p]


class LocalBinding(Binding):
    """Unix sockets in the runtime directory, or TCP on loopback with the plan's logical
    ports. A plan of several hosts numbers ports per host, so on one machine they may clash:
    then every shard and ranker port is 0 (learnt from the ready line) instead."""

    def __init__(self, plan: Plan, runtime: Path, host: str):
        self.transport = plan.transport
        self.runtime = runtime
        self.host = host
        self.logical = max(Counter(_ports(plan)).values(), default=1) == 1

    def listen(self, role: Shard | Ranker) -> str:
        if self.transport == "unix":
            return f"unix:{self.runtime / role.name}.sock"
        return f"{LOOPBACK}:{role.port if self.logical else 0}"

    def metrics_port(self, role: Shard | Ranker) -> int:
        return role.metrics_port if self.logical else 0

    def http(self, router: Router) -> tuple[str, int]:
        return self.host, router.http_port


class LocalRunner(SupervisedRunner):
    """`host`: the client address the routers bind (`cleave serve --host`); the plan does not
    hold it."""

    def __init__(self, host: str = LOOPBACK, log=None):
        super().__init__(log)
        self.host = host

    def bind(self, plan: Plan, plan_dir: Path) -> Binding:
        return LocalBinding(plan, plan_dir, self.host)
