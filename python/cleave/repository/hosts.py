"""Where a repository deployment's processes run, one kind per runner (docs/repository.md,
"Plans and runners"): how each version's roles are bound to real addresses, where the router
runs, and where the controller listens so that the router reaches it.

* `LocalHosts`: every process on this machine (`cleave serve REPO`; `--plan` with the local
  runner); the controller on loopback.
* `TestbedHosts`: one testbed of the plan's hosts for the deployment, made at start and removed
  at stop; each role in its host's namespace; one `HostPorts` for every version's binding, so
  ports stay unique on each host across versions; the controller on the testbed's bridge
  address in the root namespace, which every host reaches.
* `RayHosts` (ray_hosts.py): each role on its Ray node, under a role host.

Each also gives the deployment its supervisor (`supervisor`): a `Supervisor` of processes
here, for the local runner and the testbed."""

from __future__ import annotations

from pathlib import Path

from cleave.launch.supervisor import Supervisor
from cleave.plan import Plan
from cleave.runners.local import LOOPBACK, LocalBinding
from cleave.runners.roles import Binding
from cleave.runners.testbed import HostPorts, TestbedBinding, make_testbed
from cleave.testbed import Testbed


class LocalHosts:
    def __init__(self, host: str, port: int):
        self.host, self.port = host, port  # the router's client address (`--host`)
        self.runtime = Path(".")
        self.controller_host = LOOPBACK

    def supervisor(self, fail_stop: bool, log) -> Supervisor:
        return Supervisor(fail_stop=fail_stop, log=log, fork=True)

    def up(self, runtime: Path, say) -> None:
        self.runtime = runtime

    def bind(self, plan: Plan) -> Binding:
        # Ports 0: each version's binding knows none of the others' ports.
        return LocalBinding(plan, self.runtime, self.host, logical=False)

    def router(self) -> tuple[str, int]:
        """The router's client host and port (0: it binds one)."""
        return self.host, self.port

    def wrap_router(self, argv: list[str]) -> list[str]:
        return argv

    def changed(self, path: Path) -> None:
        """The router's JSON was rewritten: where it runs, it reads this file."""

    def free(self, roles: set[str]) -> None:
        """Roles stopped for good (their ports may go to others)."""

    def down(self) -> None:
        """Remove what up() made; after every process stopped."""


class TestbedHosts:
    def __init__(self, plan: Plan, link_gbit: float, racks: int | None, rack_mode: str):
        self.plan = plan
        self.options = (link_gbit, racks, rack_mode)
        self.testbed: Testbed | None = None
        self.ports = HostPorts()
        self.whole: TestbedBinding | None = None  # the plan's router and carried roles

    def supervisor(self, fail_stop: bool, log) -> Supervisor:
        return Supervisor(fail_stop=fail_stop, log=log, fork=True)

    def up(self, runtime: Path, say) -> None:
        self.runtime = runtime
        self.testbed = make_testbed(self.plan, *self.options, say)
        self.whole = TestbedBinding(self.plan, self.testbed, runtime, self.ports)

    @property
    def controller_host(self) -> str:
        # The router runs in its host's namespace: the root namespace is on the testbed's
        # bridge at this address, which every host's /24 route reaches (docs/testbed.md).
        return self.testbed.root_address

    def bind(self, plan: Plan) -> Binding:
        # The same HostPorts: a carried role keeps the port the whole plan's binding took.
        return TestbedBinding(plan, self.testbed, self.runtime, self.ports)

    def router(self) -> tuple[str, int]:
        return self.whole.http(self.plan.routers[0])

    def wrap_router(self, argv: list[str]) -> list[str]:
        return self.whole.wrap(self.plan.routers[0], argv)

    def changed(self, path: Path) -> None:
        pass  # the namespaces share this machine's files

    def free(self, roles: set[str]) -> None:
        self.ports.free(roles)

    def down(self) -> None:
        testbed, self.testbed = self.testbed, None
        if testbed is not None:
            testbed.down()
