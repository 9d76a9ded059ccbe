"""The testbed runner: plan host i is emulated host i of a Testbed made for the deployment
(docs/testbed.md); each role runs inside its host's network namespace on the host's address
and the plan's logical ports. The testbed is removed when the runner stops."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from cleave.errors import UsageError
from cleave.runners.roles import Binding
from cleave.runners.supervised import SupervisedRunner
from cleave.settings.addresses import LOCAL_TRANSPORTS, listen_address
from cleave.testbed import Testbed
from cleave.testbed.commands import require_privileges

if TYPE_CHECKING:
    from cleave.plan import Plan, Ranker, Router, Shard

# Host labels the runner honours (docs/testbed.md, "CPU caps"; `cleave size` writes them from
# a testbed catalog): the host's CPU cap in cores and its link's rate in Gbit/s.
CPU_LABEL, LINK_LABEL = "cpu_cores", "link_gbit"
SPARE_CORES = 1  # the caps of a plan's hosts leave this many cores for the load generator
METRICS_FROM_PORT = 1000  # a role whose plan metrics port is 0 serves them on port + this
SPARE_FROM_PORT = 20000  # other ports a plan leaves 0: the first free ones from here, per host


class HostPorts:
    """The ports handed out on each testbed host, by role and kind. Bindings that share one
    keep their roles' ports unique per host: a repository's versions are bound one at a time
    (docs/repository.md, "Plans and runners"), and must not meet on a port."""

    def __init__(self):
        self.held: dict[tuple[str, str], tuple[str, int]] = {}  # (role, kind) -> (host, port)

    def take(self, key: tuple[str, str], host: str, port: int) -> int:
        """`port` on `host` for the role's `key`, or with port 0 the first free one from
        SPARE_FROM_PORT; a role asking again gets what it has."""
        if key in self.held and self.held[key][0] == host:
            return self.held[key][1]
        owner = {hp: k for k, hp in self.held.items()}
        if port and (host, port) in owner:
            role, kind = owner[(host, port)]
            raise UsageError(
                f"host {host}: port {port} for {key[0]} ({key[1]}) is already {role}'s "
                f"({kind}); expected ports unique per host"
            )
        if not port:
            port = SPARE_FROM_PORT
            while (host, port) in owner:  # at most len(owner) steps
                port += 1
        self.held[key] = (host, port)
        return port

    def free(self, roles: set[str]) -> None:
        """The ports of roles that stopped for good."""
        self.held = {k: hp for k, hp in self.held.items() if k[0] not in roles}


class TestbedBinding(Binding):
    """The plan's ports on each host's own address. Every host is a fresh namespace, so the
    plan's ports are free there; one left 0 gets a port picked here, unused on its host by
    the roles of every binding sharing `ports`."""

    def __init__(self, plan: Plan, testbed: Testbed, runtime: Path, ports: HostPorts | None = None):
        self.plan = plan
        self.testbed = testbed
        self.runtime = runtime
        self.index = {h.name: i for i, h in enumerate(plan.hosts)}
        roles = [*plan.shards, *plan.rankers]
        wanted = {(r.name, "port"): (r.host, r.port) for r in roles}
        for r in roles:
            metrics = r.metrics_port or (r.port + METRICS_FROM_PORT if r.port else 0)
            wanted[(r.name, "metrics")] = (r.host, metrics)
        wanted.update({(r.name, "http"): (r.host, r.http_port) for r in plan.routers})
        if plan.incast_control:
            wanted.update({(r.name, "control"): (r.host, r.control_port) for r in plan.rankers})
        self.host_ports = ports or HostPorts()
        # The plan's own ports first, so that a picked one never takes a port it names.
        order = sorted(wanted.items(), key=lambda item: item[1][1] == 0)
        self.ports = {key: self.host_ports.take(key, *hp) for key, hp in order}

    def address(self, role: Shard | Ranker | Router) -> str:
        return self.testbed.hosts[self.index[role.host]].address

    def listen(self, role: Shard | Ranker) -> str:
        return listen_address(
            self.plan.transport, self.address(role), self.ports[(role.name, "port")]
        )

    def metrics_port(self, role: Shard | Ranker) -> int:
        return self.ports[(role.name, "metrics")]

    def http(self, router: Router) -> tuple[str, int]:
        return self.address(router), self.ports[(router.name, "http")]

    def control_port(self, role: Ranker) -> int:
        return self.ports[(role.name, "control")]

    def wrap(self, role: Shard | Ranker | Router, argv: list[str]) -> list[str]:
        return self.testbed.exec_argv(self.index[role.host], argv)


def testbed_name(plan_name: str) -> str:
    """The deployment's name and our pid (two deployments of one model may run at once), in
    the testbed's name alphabet and length."""
    base = re.sub(r"[^A-Za-z0-9_.-]", "-", plan_name).strip("-_.") or "cleave"
    suffix = f"-{os.getpid()}"
    return base[: 32 - len(suffix)] + suffix


def host_limits(plan: Plan) -> tuple[list[float | None], list[float | None]]:
    """Each plan host's CPU cap and link rate from its labels (None: unlabelled). The caps
    together must leave SPARE_CORES of this machine to what loads the deployment."""
    cores, gbit = [], []
    for h in plan.hosts:
        for label, out in ((CPU_LABEL, cores), (LINK_LABEL, gbit)):
            raw = h.labels.get(label)
            try:
                out.append(None if raw is None else float(raw))
            except ValueError:
                raise UsageError(
                    f"{plan.source}: host {h.name}: labels.{label}: expected a number, got {raw!r}"
                ) from None
    capped = sum(c for c in cores if c is not None)
    room = (os.cpu_count() or 1) - SPARE_CORES
    if capped > room:
        raise UsageError(
            f"{plan.source}: the hosts' labels.{CPU_LABEL} add up to {capped:g} cores; this "
            f"machine has {os.cpu_count()} and keeps {SPARE_CORES} for the load generator, so "
            f"at most {room:g} may be capped"
        )
    return cores, gbit


def make_testbed(plan: Plan, link_gbit: float, racks: int | None, rack_mode: str, say) -> Testbed:
    """A testbed of the plan's hosts, up, its control traffic prioritised; `say` logs where
    each host is. For the testbed runner and a repository deployment on the testbed."""
    if plan.transport in LOCAL_TRANSPORTS:
        # A role on a Unix socket serves its probes on its namespace's loopback, which
        # the launcher (in the root namespace) cannot reach to learn it is ready; and
        # shared memory needs the roles on one host, which testbed hosts are not.
        raise UsageError(
            f"transport: {plan.transport!r} cannot run on the testbed (its roles are not "
            "co-located: each testbed host is a namespace of its own); expected transport: "
            "tcp or mptcp"
        )
    require_privileges()  # a clear UsageError before anything is made
    cores, gbit = host_limits(plan)
    testbed = Testbed(
        len(plan.hosts),
        link_gbit=link_gbit,
        host_gbit=gbit,
        cpu_cores=cores,
        name=testbed_name(plan.name),
        racks=racks,
        mode=rack_mode,
    ).up()
    try:
        say(
            f"testbed {testbed.name!r}: "
            + ", ".join(
                f"{p.name}={h.address}" for p, h in zip(plan.hosts, testbed.hosts, strict=True)
            )
        )
        # Control connections (probes, cancels, response credits, incast control) mark their
        # packets; the emulated network honours the mark, as a datacenter's QoS would.
        from cleave._native import CONTROL_DSCP

        testbed.prioritize_dscp(CONTROL_DSCP)
    except BaseException:
        testbed.down()
        raise
    return testbed


class TestbedRunner(SupervisedRunner):
    """`link_gbit`: every host link's rate, each direction (`--link-gbit`); `racks`: the plan's
    hosts in that many racks of equal size, wired `rack_mode` (`--racks`, `--rack-mode`)."""

    __test__ = False  # not a pytest test class despite the name

    def __init__(
        self, link_gbit: float = 1.0, log=None, racks: int | None = None, rack_mode: str = "tor"
    ):
        super().__init__(log)
        self.link_gbit = link_gbit
        self.racks = racks
        self.rack_mode = rack_mode
        self.testbed: Testbed | None = None

    def bind(self, plan: Plan, plan_dir: Path) -> Binding:
        self.testbed = make_testbed(plan, self.link_gbit, self.racks, self.rack_mode, self._say)
        binding = TestbedBinding(plan, self.testbed, plan_dir)
        if plan.incast_control:
            # Grants never wait behind payloads on a shaped link (docs/traffic.md).
            for port in sorted({binding.control_port(r) for r in plan.rankers}):
                self.testbed.prioritize_port(port)
        return binding

    def release(self) -> None:
        testbed, self.testbed = self.testbed, None
        if testbed is not None:
            testbed.down()
