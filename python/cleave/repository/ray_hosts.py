"""A repository plan on a Ray cluster: `cleave serve --plan REPO_PLAN --runner ray`
(docs/repository.md, "Plans and runners"). The controller, the versions' bookkeeping and the
router's JSON stay in the `cleave serve` process (the Ray driver), as on the other runners;
each role runs under a `RoleHost` actor (runners/ray_actors.py) on the node its plan host maps
to, which picks the role's ports there and restarts its process when it dies.

* `RayHosts`: the hosts of the deployment (hosts.py's interface): it connects, maps the plan's
  hosts to nodes (by label, as the Ray runner does), checks they have room, and binds each role
  to a role host on its node.
* `RaySupervisor`: what the local runners' `Supervisor` is to `Served` and the deployment:
  start, retire, watch and stop, here through the role hosts.

A role host is owned by the driver: if `cleave serve` dies, Ray stops its role hosts and their
processes with it. Unlike a one-bundle Ray deployment (docs/ray.md), the roles of a dead node
are not placed again: the router's routes fail over to the replicas on other nodes, and the
version serves on while a replica of each range and one of its rankers live."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from cleave.errors import UsageError
from cleave.launch.supervisor import ChildFailed, ChildSpec, probe_ready
from cleave.plan import Plan
from cleave.runners.ray import check_capacity, connect, map_hosts
from cleave.runners.ray_actors import (
    RayBinding,
    bind_ports,
    live_nodes,
    new_role_host,
    role_env,
    stop_role_hosts,
)
from cleave.runners.roles import Binding
from cleave.runners.supervised import read_internal_secret

ROUTER = "router"  # the deployment's router child (deployment.py names it so)
WATCH_EVERY_S = 1.0
STATE_TIMEOUT_S = 10.0  # a role host that does not answer in this long is asked again later


@dataclass
class Started:
    spec: ChildSpec  # as a Supervisor's Child: what the deployment reads back


class RayHosts:
    """`address`: the Ray head's HOST:PORT (`--ray-address`); None: $RAY_ADDRESS, else a Ray
    started here for the deployment."""

    def __init__(self, plan: Plan, address: str | None):
        if plan.transport != "tcp":
            raise UsageError(
                f"{plan.where()}: the Ray runner runs plans over TCP; got transport "
                f"{plan.transport!r} (use --runner local for it)"
            )
        self.plan = plan
        self.address = address
        self.ray = None
        self.say = print
        self.mapping: dict[str, str] = {}  # plan host -> node id
        self.nodes: dict[str, dict] = {}
        self.binding = RayBinding()
        self.actors: dict[str, object] = {}  # role name -> its role host
        self.secret: str | None = None  # the internal secret, if the plan names one
        self.router_json = ""  # the router's JSON: it travels to the router's node

    def supervisor(self, fail_stop: bool, log) -> RaySupervisor:
        return RaySupervisor(self, fail_stop, log)

    def up(self, runtime: Path, say) -> None:
        self.say = say
        ray = self.ray = connect(self.address, self.plan.name)
        self.nodes = live_nodes(ray)
        self.mapping = map_hosts(self.plan, self.nodes)
        check_capacity(self.plan, self.mapping, self.nodes)
        self.secret = read_internal_secret(self.plan.router.internal_secret_env)
        say(
            "Ray nodes: "
            + ", ".join(f"{h}={self.nodes[n]['ip']}({n[:8]})" for h, n in self.mapping.items())
        )

    @property
    def controller_host(self) -> str:
        # The router runs on its node: the controller listens on this node's address.
        return self.ray.util.get_node_ip_address()

    def bind(self, plan: Plan) -> Binding:
        """Role hosts for a version's shards and rankers on their nodes, and their ports."""
        roles = [("shard", s) for s in plan.shards] + [("ranker", r) for r in plan.rankers]
        self._place(roles)
        return self.binding

    def router(self) -> tuple[str, int]:
        router = dataclasses.replace(self.plan.routers[0], name=ROUTER)
        self._place([("router", router)], first=router.http_port)
        return self.binding.http(router)

    def wrap_router(self, argv: list[str]) -> list[str]:
        self.router_json = argv[-1]  # cleave-router CONFIG
        return argv

    def files(self, spec: ChildSpec) -> dict[str, str]:
        """The files a role reads on its node: the router's JSON."""
        if spec.name != ROUTER:
            return {}
        return {self.router_json: Path(self.router_json).read_text()}

    def changed(self, path: Path) -> None:
        """The router's JSON was rewritten (a version loaded or unloaded): its node gets the
        new one, which a restart of the router reads."""
        actor = self.actors.get(ROUTER)
        if actor is not None and str(path) == self.router_json:
            self.ray.get(actor.write.remote({self.router_json: path.read_text()}), timeout=30)

    def _place(self, roles: list[tuple[str, object]], first: int = 0) -> None:
        """A role host for each (kind, role) on its host's node, and the role's ports there;
        `first`: a router's plan port, if not 0."""
        token_env = self.plan.router.admin_token_env
        token = os.environ.get(token_env) if token_env else None
        fail_stop = self.plan.supervision.fail_stop
        for kind, role in roles:
            node = self.mapping[role.host]
            env = role_env(kind, token_env, token, self.secret)
            gpus = self.nodes[node]["gpus"]
            self.actors[role.name], _ = new_role_host(kind, role, node, gpus, fail_stop, env)
            self.say(f"role {role.name} on Ray node {node} ({self.nodes[node]['ip']})")
        hosts = [(role.name, self.actors[role.name], first) for _, role in roles]
        bind_ports(self.binding, hosts, self.plan.supervision.ready_timeout_s)

    def free(self, roles: set[str]) -> None:
        for name in roles:
            self.binding.where.pop(name, None)

    def down(self) -> None:
        ray, self.ray = self.ray, None
        if ray is not None:
            ray.shutdown()


class RaySupervisor:
    """The roles of a Ray repository deployment, through their role hosts (RayHosts)."""

    def __init__(self, hosts: RayHosts, fail_stop: bool, log=None):
        self.hosts = hosts
        self.fail_stop = fail_stop
        self.log = log or sys.stderr
        self.stopping = threading.Event()
        self.running: list[str] = []  # role names, in the order they started
        self.lost: set[str] = set()  # roles whose node died
        self._lock = threading.Lock()

    def say(self, message: str) -> None:
        try:
            print(f"cleave serve: {message}", file=self.log, flush=True)
        except (ValueError, OSError):
            pass

    def start(self, specs: list[ChildSpec], timeout_s: float) -> list[Started]:
        """Starts the roles together on their nodes and waits until each is ready, there and
        as seen from here (its clients' view)."""
        hosts, ray = self.hosts, self.hosts.ray
        refs = [hosts.actors[s.name].run.remote(s, hosts.files(s), timeout_s) for s in specs]
        with self._lock:
            self.running += [s.name for s in specs]
        waited = 0.0
        while waited < timeout_s + 30:
            if self.stopping.is_set():
                raise ChildFailed("stopped while starting roles")
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0.5)
            if len(done) == len(refs):
                break
            waited += 0.5
        else:
            raise ChildFailed(f"{', '.join(s.name for s in specs)}: not ready after {timeout_s} s")
        for spec, ref in zip(specs, refs, strict=True):
            try:
                spec.reported.update(ray.get(ref))
            except ray.exceptions.RayError as err:
                raise ChildFailed(f"{spec.name}: {getattr(err, 'cause', None) or err}") from None
            ok, answer = probe_ready(spec.ready_url)
            if not ok:
                raise ChildFailed(f"{spec.name}: GET {spec.ready_url} answered {answer}")
        return [Started(spec) for spec in specs]

    def retire(self, names: set[str], timeout_s: float) -> None:
        """Stops these roles for good and removes their role hosts."""
        ray = self.hosts.ray
        with self._lock:
            self.running = [n for n in self.running if n not in names]
        for name in names:
            actor = self.hosts.actors.pop(name, None)
            if actor is None:
                continue
            try:
                ray.get(actor.retire.remote(timeout_s), timeout=timeout_s + 30)
            except ray.exceptions.RayError:
                pass  # its node is gone, and its process with it
            ray.kill(actor)

    def watch(self, ready_timeout_s: float) -> int:
        """Until stop(): 0. With fail-stop, 1 as soon as a role failed or its node died."""
        ray = self.hosts.ray
        while not self.stopping.wait(WATCH_EVERY_S):
            with self._lock:
                names = [n for n in self.running if n not in self.lost]
            for name in names:
                actor = self.hosts.actors.get(name)
                if actor is None:
                    continue
                try:
                    state = ray.get(actor.state.remote(), timeout=STATE_TIMEOUT_S)
                except ray.exceptions.GetTimeoutError:
                    continue
                except ray.exceptions.RayActorError as err:
                    self.lost.add(name)
                    self.say(f"{name}: its Ray node is gone ({err}); its replicas serve on")
                    state = "failed"
                if state == "failed" and self.fail_stop:
                    self.say(f"{name} failed; stopping the deployment (fail-stop)")
                    return 1
        return 0

    def request_stop(self) -> None:
        self.stopping.set()

    def stop(self, timeout_s: float) -> dict[str, int]:
        """The router first, then shards and rankers; each process SIGTERM, SIGKILL after
        `timeout_s`. Returns each role's exit code."""
        self.stopping.set()
        if self.hosts.ray is None:
            return {}
        hosts = list(self.hosts.actors.items())
        self.hosts.actors.clear()
        routers = [h for h in hosts if h[0] == ROUTER]
        codes = stop_role_hosts(routers, timeout_s)
        return codes | stop_role_hosts([h for h in hosts if h[0] != ROUTER], timeout_s)
