"""The local runner: every role of a plan is a process on this machine, whatever logical host
the plan puts it on (docs/plan.md, "Runners")."""

from __future__ import annotations

import random
import socket
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from cleave.runners.roles import Binding
from cleave.runners.supervised import SupervisedRunner
from cleave.settings.addresses import LOCAL_TRANSPORTS, listen_address, path_address

if TYPE_CHECKING:
    from cleave.plan import Plan, Ranker, Router, Shard

LOOPBACK = "127.0.0.1"


def _ports(plan: Plan) -> list[int]:
    """Every non-zero port the plan names, all hosts together."""
    ports = [p for r in [*plan.shards, *plan.rankers] for p in (r.port, r.metrics_port)]
    if plan.incast_control:
        ports += [r.control_port for r in plan.rankers]
    return [p for p in ports + [r.http_port for r in plan.routers] if p]


# The kernel hands its ephemeral ports (ip_local_port_range) to every connect() and bind(0) on
# the machine, so a port picked from there can be taken by any outgoing connection before the
# role binds it (a Ray role's start-up makes dozens). Ports outside it are taken only by a
# process that names them. Below QUIET_FROM lie well-known services and Ray's worker ports
# (10002-19999 by default).
QUIET_FROM = 20000
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
PICKS_PER_PORT = 64  # candidates tried per port wanted before giving up


def quiet_candidates(ephemeral: Path = EPHEMERAL) -> list[int]:
    """Ports from QUIET_FROM up that the kernel never hands out by itself."""
    try:
        low, high = map(int, ephemeral.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return [p for p in range(QUIET_FROM, 65536) if not low <= p <= high]


def free_ports(host: str, n: int) -> list[int]:
    """`n` distinct ports free on `host` now, from outside the kernel's ephemeral range
    (`quiet_candidates`): bound all at once (so none repeats), then released for the roles
    to bind. A process naming one could still take it in between; the role then fails to
    start, named, rather than serving somewhere unknown. For ports a role cannot be given as
    0 (Ray's roles, whose addresses are fixed before they start)."""
    candidates = quiet_candidates()
    socks: list[socket.socket] = []
    try:
        for _ in range(PICKS_PER_PORT * n):
            if len(socks) == n:
                break
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            try:
                s.bind((host, random.choice(candidates)))
            except OSError:  # taken (or lingering in TIME_WAIT): another one
                s.close()
                continue
            socks.append(s)
        if len(socks) < n:
            raise RuntimeError(f"no {n} free ports on {host} outside the ephemeral range")
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalBinding(Binding):
    """Unix sockets in the runtime directory, or TCP on loopback with the plan's logical
    ports. A plan of several hosts numbers ports per host, so on one machine they may clash:
    then every shard and ranker port is 0. A port the plan leaves 0 stays 0 too. A role
    given port 0 binds a free one itself and says which (docs/plan.md, "Runners"); the
    supervisor takes it from there, and a restarted role comes back on it (a ranker's incast
    control port too: `--incast-control --control-port 0`). `logical=False`: every shard
    and ranker port is 0 whatever the plan says (a repository's versions are bound one at a
    time, each unaware of the ports of the others)."""

    def __init__(self, plan: Plan, runtime: Path, host: str, logical: bool = True):
        self.transport = plan.transport
        self.runtime = runtime
        self.host = host
        logical = logical and max(Counter(_ports(plan)).values(), default=1) == 1
        self.ports: dict[tuple[str, str], int] = {}
        for role in [*plan.shards, *plan.rankers]:
            if self.transport not in LOCAL_TRANSPORTS:
                self.ports[(role.name, "port")] = role.port if logical else 0
            self.ports[(role.name, "metrics")] = role.metrics_port if logical else 0
        if plan.incast_control:
            for r in plan.rankers:
                self.ports[(r.name, "control")] = r.control_port if logical else 0
        # Routers bind the client host; the rest loopback (`cleave serve --host` is for clients).
        for router in plan.routers:
            self.ports[(router.name, "http")] = router.http_port

    def listen(self, role: Shard | Ranker) -> str:
        if self.transport in LOCAL_TRANSPORTS:
            return path_address(self.transport, self.runtime / f"{role.name}.sock")
        return listen_address(self.transport, LOOPBACK, self.ports[(role.name, "port")])

    def metrics_port(self, role: Shard | Ranker) -> int:
        return self.ports[(role.name, "metrics")]

    def http(self, router: Router) -> tuple[str, int]:
        return self.host, self.ports[(router.name, "http")]

    def control_port(self, role: Ranker) -> int:
        return self.ports[(role.name, "control")]


class LocalRunner(SupervisedRunner):
    """`host`: the client address the routers bind (`cleave serve --host`); the plan does not
    hold it."""

    def __init__(self, host: str = LOOPBACK, log=None):
        super().__init__(log)
        self.host = host

    def bind(self, plan: Plan, plan_dir: Path) -> Binding:
        return LocalBinding(plan, plan_dir, self.host)
