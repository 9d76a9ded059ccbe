"""The Ray runner's actors (docs/ray.md). Plain classes here, made Ray actors by `ray.remote`
where they are created, so this module imports without Ray.

* `RoleHost`: one per role, on the node its plan host maps to. It picks the role's ports on
  its node and runs the role's process under a one-role `Supervisor` (the same command line as
  every runner, from `RoleSpecs`), restarting it with backoff when it dies.
* `Controller`: one per deployment, detached, named `controller` in the deployment's Ray
  namespace. It owns the role hosts, re-places the roles of a dead node and readmits them, and
  scales rankers and shard replicas through the routers' membership API (`cleave scale`)."""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from cleave.errors import UsageError
from cleave.launch.supervisor import ChildFailed, ChildSpec, Supervisor, probe_ready, probe_text
from cleave.runners import membership
from cleave.runners.local import free_ports
from cleave.runners.roles import (
    Binding,
    RoleSpecs,
    control_address,
    pin_dense_dtype,
    rankers_choose,
)
from cleave.runners.supervised import INTERNAL_SECRET

log = logging.getLogger("cleave.ray")

CONTROLLER = "controller"
HEAL_EVERY_S = 0.5  # how often the controller looks for dead role hosts
STATE_TIMEOUT_S = 10.0  # a role host that does not answer in this long is asked again later
DRAIN_TIMEOUT_S = 30.0  # a drained member with requests still in flight after this is removed
# One lock file per port a role host holds, shared by every role host of this machine.
PORT_BOOK = Path(tempfile.gettempdir()) / f"cleave-ray-ports-{os.getuid()}"
PORT_TRIES = 64  # free ports asked of the kernel per port wanted before giving up


def hold_ports(ip: str, n: int, book: Path = PORT_BOOK, offer=None) -> tuple[list[int], list[int]]:
    """`n` ports free on `ip` now that no other live role host of this machine holds, and the
    open lock files that hold them (closed, or their process dead, they are free again). A
    role's port is free while its process restarts, so without this another role host could
    be handed it in that moment and the restarted role would find it taken. `offer()` is the
    next candidate port (the kernel's free one; a test steers it)."""
    offer = offer or (lambda: free_ports(ip, 1)[0])
    book.mkdir(parents=True, exist_ok=True)
    ports: list[int] = []
    locks: list[int] = []
    for _ in range(PORT_TRIES * n):
        if len(ports) == n:
            return ports, locks
        port = offer()
        if port in ports:
            continue
        fd = os.open(book / str(port), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        ports.append(port)
        locks.append(fd)
    if len(ports) == n:
        return ports, locks
    for fd in locks:
        os.close(fd)
    raise RuntimeError(f"no {n} free ports on {ip} that another role host does not hold")


def role_needs(kind: str, role, node_gpus: float = 0.0) -> tuple[float, float]:
    """(CPUs, GPUs) a role reserves on its Ray node: its threads (a router: one core); a
    ranker on `cuda` one GPU, on `auto` one where its node has one."""
    if kind == "router":
        return 1.0, 0.0
    gpus = 0.0
    if kind == "ranker" and (role.device == "cuda" or (role.device == "auto" and node_gpus)):
        gpus = 1.0
    return float(role.threads), gpus


def live_nodes(ray) -> dict[str, dict]:
    """node id -> {"ip", "cpus", "gpus", "labels"} for every live node."""
    return {
        n["NodeID"]: {
            "ip": n["NodeManagerAddress"],
            "cpus": float(n["Resources"].get("CPU", 0)),
            "gpus": float(n["Resources"].get("GPU", 0)),
            "labels": dict(n.get("Labels") or {}),
        }
        for n in ray.nodes()
        if n.get("Alive")
    }


class RoleHost:
    """Runs one role's process on its node."""

    def __init__(self, name: str, fail_stop: bool, env: dict[str, str] | None = None):
        self.name = name
        self.supervisor = Supervisor(fail_stop=fail_stop, env={**os.environ, **(env or {})})
        self.result: int | None = None  # Supervisor.watch's, once it returned
        self.port_locks: list[int] = []  # hold_ports's, for as long as the role may restart

    def where(self, ports: int, first: int = 0) -> tuple[str, list[int]]:
        """This node's address and `ports` ports for the role to bind: `first` if not 0 (a
        router's plan port: its clients' URL), the others free on the node now and held for
        this role until it stops (`hold_ports`)."""
        import ray

        ip = ray.util.get_node_ip_address()
        fixed = [first] if first else []
        self.release_ports()  # asked again: the ports it held before are not the role's now
        picked, self.port_locks = hold_ports(ip, ports - len(fixed))
        return ip, [*fixed, *picked]

    def release_ports(self) -> None:
        for fd in self.port_locks:
            os.close(fd)
        self.port_locks = []

    def run(self, spec: ChildSpec, files: dict[str, str], ready_timeout_s: float) -> dict:
        """Writes `files` (a router's JSON), starts the role and returns once its /ready
        answered 200 (ChildFailed otherwise), with what its ready line reported; then
        supervises it."""
        self.write(files)
        (child,) = self.supervisor.start([spec], ready_timeout_s)
        threading.Thread(target=self._watch, args=(ready_timeout_s,), daemon=True).start()
        return dict(child.spec.reported)

    def write(self, files: dict[str, str]) -> None:
        """Files the role reads on this node (a router's JSON, rewritten when it changes: a
        restart reads the latest)."""
        for path, text in files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(f"{path}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)

    def _watch(self, ready_timeout_s: float) -> None:
        self.result = self.supervisor.watch(ready_timeout_s)

    def state(self) -> str:
        """`ready`, `restarting` (its process died and is on its way back) or `failed`
        (fail-stop: it died and stays down)."""
        if self.result == 1:
            return "failed"
        return "restarting" if self.supervisor._recovering else "ready"

    def stop(self, timeout_s: float) -> dict[str, int]:
        try:
            return self.supervisor.stop(timeout_s)
        finally:
            self.release_ports()

    def retire(self, timeout_s: float) -> None:
        """Kills the role for good (Supervisor.retire: a model version unloaded)."""
        try:
            self.supervisor.retire({self.name}, timeout_s)
        finally:
            self.release_ports()


class RayBinding(Binding):
    """Each role on its node's address and the ports its role host picked there."""

    def __init__(self):
        self.where: dict[str, tuple[str, list[int]]] = {}

    def listen(self, role) -> str:
        ip, ports = self.where[role.name]
        return f"{ip}:{ports[0]}"

    def metrics_port(self, role) -> int:
        return self.where[role.name][1][1]

    def http(self, router) -> tuple[str, int]:
        ip, ports = self.where[router.name]
        return ip, ports[0]


def role_env(kind: str, token_env: str, token: str | None, secret: str | None) -> dict:
    """What a role's process gets in its environment from its role host: Ray's workers do
    not see the driver's. A router: the admin token in the variable the plan names; every
    role: the internal secret (docs/security.md)."""
    env = {}
    if kind == "router" and token and token_env:
        env[token_env] = token
    if secret:
        env[INTERNAL_SECRET] = secret
    return env


def new_role_host(kind: str, role, node: str, node_gpus: float, fail_stop: bool, env: dict):
    """A `RoleHost` for `role` pinned to `node`, reserving the role's CPUs and GPUs there:
    (the actor, its (CPUs, GPUs)). Ray never restarts it: a dead node's roles are placed
    again by their owner (the one-bundle controller), or not at all."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    needs = role_needs(kind, role, node_gpus)
    actor = (
        ray.remote(RoleHost)
        .options(
            num_cpus=needs[0],
            num_gpus=needs[1],
            max_concurrency=4,  # state() answers while run() waits for readiness
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        )
        .remote(role.name, fail_stop, env)
    )
    return actor, needs


def bind_ports(binding: RayBinding, hosts: list[tuple[str, object, int]], timeout: float):
    """Each (role name, role host, first port) picks the role's ports on its node (listen,
    metrics, control; `first`: a router's plan port, if not 0) into `binding`; ChildFailed
    naming the roles not placed within `timeout`."""
    import ray

    wheres = [actor.where.remote(3, first) for _, actor, first in hosts]
    ready, _ = ray.wait(wheres, num_returns=len(wheres), timeout=timeout)
    if len(ready) < len(wheres):
        late = [name for (name, _, _), w in zip(hosts, wheres, strict=True) if w not in ready]
        raise ChildFailed(
            f"{', '.join(late)}: not placed on their Ray nodes after {timeout:.0f} s "
            "(is the node short of CPUs or GPUs, or gone?)"
        )
    for (name, _, _), where in zip(hosts, ray.get(wheres), strict=True):
        binding.where[name] = where


def stop_role_hosts(hosts: list[tuple[str, object]], timeout_s: float) -> dict[str, int]:
    """Stops each (role name, role host)'s process together (SIGTERM, SIGKILL after
    `timeout_s`) and kills the role hosts: each role's exit code (-9 where its node is
    gone)."""
    import ray

    refs = [actor.stop.remote(timeout_s) for _, actor in hosts]
    codes: dict[str, int] = {}
    for (name, actor), ref in zip(hosts, refs, strict=True):
        try:
            codes.update(ray.get(ref, timeout=timeout_s + 30))
        except ray.exceptions.RayError:
            codes[name] = -9
        ray.kill(actor)
    return codes


@dataclass
class Placed:
    kind: str  # shard | ranker | router
    role: object  # the plan's Shard, Ranker or Router
    actor: object
    node: str  # Ray node id
    spec: ChildSpec | None = None
    needs: tuple[float, float] = (0.0, 0.0)


def _unwrap(err: BaseException) -> str:
    cause = getattr(err, "cause", None)
    return str(cause) if cause is not None else str(err)


class Controller:
    """A deployment's state on the cluster. `nodes`: node id -> {"ip", "cpus", "gpus"};
    `mapping`: plan host -> node id; `token`: the routers' admin token (or None); `secret`:
    the internal secret every role proves (or None; docs/security.md)."""

    def __init__(
        self, plan, mapping: dict[str, str], nodes: dict[str, dict], token=None, secret=None
    ):
        logging.basicConfig(level=logging.INFO, format="cleave ray: %(message)s")
        self.plan = plan
        self.mapping = mapping
        self.nodes = nodes
        self.token = token
        self.secret = secret
        self.runtime = Path(tempfile.mkdtemp(prefix=f"cleave-ray-{plan.name}-"))
        self.binding = RayBinding()
        self.placed: dict[str, Placed] = {}
        self.lock = threading.RLock()  # one membership change at a time: heal or scale
        self.stopping = threading.Event()
        self.failed: str | None = None
        self.events: list[str] = []  # what healing and scaling did, for `status`

    # -- placing roles -------------------------------------------------------------------------
    def _used(self, exclude: str = "") -> Counter:
        used: Counter = Counter()
        for name, p in self.placed.items():
            if name != exclude:
                used[(p.node, "cpu")] += p.needs[0]
                used[(p.node, "gpu")] += p.needs[1]
        return used

    def _choose(self, kind: str, role, prefer: str | None, avoid: set[str]) -> str:
        """A live node with room for the role: `prefer` if it fits, else the least used one
        outside `avoid` (a shard's group's other replicas), else any that fits."""
        import ray

        live = live_nodes(ray)
        self.nodes.update(live)  # nodes that joined since start are room too
        alive = set(live)
        used = self._used(exclude=role.name)

        def fits(node: str) -> bool:
            info = self.nodes[node]
            cpus, gpus = role_needs(kind, role, info["gpus"])
            return (
                used[(node, "cpu")] + cpus <= info["cpus"]
                and used[(node, "gpu")] + gpus <= info["gpus"]
            )

        candidates = [n for n in self.nodes if n in alive and fits(n)]
        if prefer in candidates and prefer not in avoid:
            return prefer
        for pool in ([n for n in candidates if n not in avoid], candidates):
            if pool:
                return min(pool, key=lambda n: used[(n, "cpu")] / max(self.nodes[n]["cpus"], 1))
        raise UsageError(
            f"{role.name}: no live Ray node has room for it "
            f"({role_needs(kind, role)[0]:.0f} CPUs); add nodes or lower the plan's threads"
        )

    def _group_nodes(self, group: int, exclude: str = "") -> set[str]:
        return {
            p.node
            for n, p in self.placed.items()
            if p.kind == "shard" and p.role.group == group and n != exclude
        }

    def _create(self, kind: str, role, node: str) -> Placed:
        env = role_env(kind, self.plan.router.admin_token_env, self.token, self.secret)
        fail_stop = self.plan.supervision.fail_stop
        actor, needs = new_role_host(kind, role, node, self.nodes[node]["gpus"], fail_stop, env)
        return Placed(kind, role, actor, node, needs=needs)

    def _launch(self, placed: list[Placed]) -> None:
        """Picks each role's ports on its node, starts them together, waits for every one
        to be ready (the role host's probe, then ours), and records them."""
        import ray

        timeout = self.plan.supervision.ready_timeout_s
        hosts = [
            (p.role.name, p.actor, p.role.http_port if p.kind == "router" else 0) for p in placed
        ]
        bind_ports(self.binding, hosts, timeout)
        for p in placed:
            if p.spec is None:
                p.spec = self._spec(p)
        specs = RoleSpecs(self.plan, self.binding, self.runtime)
        runs = []
        for p in placed:
            # A router's JSON goes with it: its node may not see the controller's files.
            path = specs.config_path(p.role.name)
            files = {str(path): path.read_text()} if p.kind == "router" else {}
            runs.append(p.actor.run.remote(p.spec, files, timeout))
        try:
            ray.get(runs, timeout=timeout + 30)
        except ray.exceptions.RayTaskError as err:
            raise ChildFailed(_unwrap(err)) from None
        except ray.exceptions.GetTimeoutError:
            raise ChildFailed(f"roles not ready after {timeout:.0f} s") from None
        for p in placed:  # the driver side's own check, over the network, as clients see it
            ok, answer = probe_ready(p.spec.ready_url)
            if not ok:
                raise ChildFailed(f"{p.role.name}: GET {p.spec.ready_url} answered {answer}")
            if p.kind == "ranker" and specs.measures_activation():  # the routers' cache needs it
                from cleave.ranker.probes import measured_activation

                metrics = probe_text(f"{p.spec.probe}/metrics")
                p.spec.reported["activation"] = str(measured_activation(metrics))
            self.placed[p.role.name] = p

    def _spec(self, p: Placed) -> ChildSpec:
        one = dataclasses.replace(
            self.plan,
            shards=[p.role] if p.kind == "shard" else [],
            rankers=[p.role] if p.kind == "ranker" else [],
        )
        specs = RoleSpecs(one, self.binding, self.runtime)
        if p.kind == "shard":
            return specs.shard_specs()[0]
        if p.kind == "ranker":
            return specs.ranker_specs()[0]
        shards = RoleSpecs(self.plan, self.binding, self.runtime)
        return shards.router_specs(
            [self.placed[s.name].spec for s in self.plan.shards],
            [self.placed[r.name].spec for r in self.plan.rankers],
        )[[r.name for r in self.plan.routers].index(p.role.name)]

    # -- the deployment ------------------------------------------------------------------------
    def start(self) -> list[str]:
        """Shards and rankers (in parallel), then routers; returns the routers' URLs."""
        with self.lock:
            shards = [self._create("shard", s, self.mapping[s.host]) for s in self.plan.shards]
            rankers = [self._create("ranker", r, self.mapping[r.host]) for r in self.plan.rankers]
            if rankers_choose(self.plan):  # the first ranker chooses the dense dtype for all
                self._launch([*shards, rankers[0]])
                self._pin_dense_dtype(rankers)
                if len(rankers) > 1:
                    self._launch(rankers[1:])
            else:
                self._launch([*shards, *rankers])
            routers = [self._create("router", r, self.mapping[r.host]) for r in self.plan.routers]
            self._launch(routers)
        threading.Thread(target=self._heal_loop, daemon=True).start()
        return self.urls()

    def _pin_dense_dtype(self, rankers: list[Placed]) -> None:
        """The first ranker's dense dtype (its /metrics says which) becomes the plan's: every
        ranker started later — the others now, re-placed or added ones — serves it too."""
        from cleave.ranker.probes import served_dtype

        first = rankers[0]
        dtype = served_dtype(probe_text(f"{first.spec.probe}/metrics"))
        if dtype is None:
            raise ChildFailed(f"{first.role.name}: its /metrics names no dense dtype")
        self.plan.rankers[:] = [
            dataclasses.replace(r, dense_dtype=dtype) for r in self.plan.rankers
        ]
        for p, role in zip(rankers, self.plan.rankers, strict=True):
            p.role = role
        pin_dense_dtype([first.spec], dtype)

    def urls(self) -> list[str]:
        return [self.placed[r.name].spec.probe for r in self.plan.routers]

    def status(self) -> dict:
        """Every role's node, address, probe and state; the deployment's failure, if any."""
        with self.lock:
            roles = {
                name: {
                    "kind": p.kind,
                    "node": p.node,
                    "address": p.spec.address if p.spec else "",
                    "probe": p.spec.probe if p.spec else "",
                }
                for name, p in self.placed.items()
            }
        return {
            "failed": self.failed,
            "roles": roles,
            "urls": self.urls(),
            "events": list(self.events),
        }

    def _note(self, message: str) -> None:
        log.info(message)
        self.events.append(message)

    def _heal_loop(self) -> None:
        while not self.stopping.wait(HEAL_EVERY_S):
            try:
                self._heal_once()
            except Exception as err:  # keep healing; say why (once, not every round)
                message = f"healing failed, trying again: {err}"
                if not self.events or self.events[-1] != message:
                    self._note(message)

    def _heal_once(self) -> None:
        import ray

        # Ask every role host at once: one on a dead node may hang until Ray declares it dead.
        asked = {name: (p, p.actor.state.remote()) for name, p in list(self.placed.items())}
        refs = [ref for _, ref in asked.values()]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=STATE_TIMEOUT_S)
        for name, (p, ref) in asked.items():
            if self.stopping.is_set():
                return
            if ref not in done:
                continue
            try:
                state = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                self._replace(name, p, err)
                continue
            if state == "failed" and self.failed is None:
                self.failed = f"{name} died (fail-stop)"

    def _replace(self, name: str, p: Placed, err: BaseException) -> None:
        """A dead role host (its node died): start the role on a live node, add it to every
        router, then remove the dead address."""
        import ray

        with self.lock:
            if self.stopping.is_set() or self.placed.get(name) is not p:
                return
            if p.kind == "router":
                self.failed = f"{name}'s Ray node died; its clients' URL is gone ({err})"
                return
            began = time.monotonic()
            old = p.spec.address
            avoid = self._group_nodes(p.role.group, exclude=name) if p.kind == "shard" else set()
            node = self._choose(p.kind, p.role, None, avoid | {p.node})
            fresh = self._create(p.kind, p.role, node)
            try:
                self._launch([fresh])  # replaces the dead entry once ready
            except BaseException:
                ray.kill(fresh.actor)  # the dead entry stays: the next round tries again
                raise
            self._admit(fresh)
            self._leave(p.kind, old, drain=False)
            self._note(
                f"{name}: its host died; re-placed on node {self.nodes[node]['ip']} "
                f"({old} -> {fresh.spec.address}) in {time.monotonic() - began:.1f} s"
            )

    # -- membership ----------------------------------------------------------------------------
    def _routers(self) -> list[str]:
        return [self.placed[r.name].spec.probe for r in self.plan.routers]

    def _admit(self, p: Placed) -> None:
        for url in self._routers():
            if p.kind == "shard":
                ranges = [
                    {"table": t, "row_start": a, "row_end": b}
                    for t, (a, b) in p.role.ranges.items()
                ]
                membership.add_shard(url, p.spec.address, ranges, self.token)
            else:
                control = None
                if self.plan.incast_control and self.plan.mode != "monolithic":
                    port = self.binding.control_port(p.role)
                    control = control_address(p.spec.address, port)
                membership.add_ranker(url, p.spec.address, self.token, control=control)
        # Done when every router takes work to it (it probes a new member at once).
        group = "shards" if p.kind == "shard" else "rankers"
        deadline = time.monotonic() + self.plan.supervision.ready_timeout_s
        for url in self._routers():
            while self._state(url, group, p.spec.address) != "active":
                if time.monotonic() > deadline:
                    raise ChildFailed(f"{p.role.name} at {p.spec.address}: {url} never took it")
                time.sleep(0.05)

    def _state(self, url: str, group: str, address: str) -> str:
        for m in membership.members(url, self.token)[group]:
            if m["addr"] == address:
                return m["state"]
        return "absent"

    def _leave(self, kind: str, address: str, drain: bool) -> None:
        """Removes `address` from every router; with `drain`, first sends it no new work and
        waits (bounded) for its requests in flight."""
        group = "shards" if kind == "shard" else "rankers"
        for url in self._routers():
            try:
                if drain:
                    membership.drain(url, group, address, self.token)
                    deadline = time.monotonic() + DRAIN_TIMEOUT_S
                    while time.monotonic() < deadline and self._outstanding(url, group, address):
                        time.sleep(0.05)
                membership.remove(url, group, address, self.token)
            except membership.MembershipError as err:
                if err.status != 404:  # already gone is fine
                    raise

    def _outstanding(self, url: str, group: str, address: str) -> int:
        for m in membership.members(url, self.token)[group]:
            if m["addr"] == address:
                return int(m.get("outstanding", 0))
        return 0

    def _retire(self, name: str) -> None:
        import ray

        p = self.placed[name]
        self._leave(p.kind, p.spec.address, drain=True)
        try:
            ray.get(p.actor.stop.remote(self.plan.supervision.stop_timeout_s), timeout=60)
        except ray.exceptions.RayError:
            pass
        ray.kill(p.actor)
        del self.placed[name]

    # -- scaling -------------------------------------------------------------------------------
    def scale(self, rankers: int | None, replicas: int | None) -> dict:
        """Brings the rankers to `rankers` and every range group to `replicas` replicas: new
        roles are started and ready before the routers get them; removed ones are drained,
        then stopped. Returns the roles after."""
        if self.failed:
            raise UsageError(f"deployment {self.plan.name!r} has failed: {self.failed}")
        with self.lock:
            if rankers is not None:
                self._scale_rankers(rankers)
            if replicas is not None:
                self._scale_replicas(replicas)
        return self.status()

    def _add(self, kind: str, roles: list, prefer) -> None:
        """Places `roles` (each on `prefer(role)`'s node if it has room; a shard away from its
        group's replicas), starts them, and admits them on every router once ready. On failure
        undoes it all: the deployment is as before."""
        import ray

        placed: list[Placed] = []
        try:
            for role in roles:
                avoid = self._group_nodes(role.group) if kind == "shard" else set()
                p = self._create(kind, role, self._choose(kind, role, prefer(role), avoid))
                placed.append(p)
                self.placed[role.name] = p  # counted by the next _choose and _group_nodes
            for p in placed:
                del self.placed[p.role.name]
            self._launch(placed)
            for p in placed:
                self._admit(p)
        except BaseException:
            for p in placed:
                self.placed.pop(p.role.name, None)
                if p.spec is not None:
                    try:
                        self._leave(kind, p.spec.address, drain=False)
                    except membership.MembershipError:
                        pass  # it never took work
                ray.kill(p.actor)
            raise

    def _scale_rankers(self, want: int) -> None:
        have = list(self.plan.rankers)
        if want > len(have):
            taken = {r.name for r in self.plan.rankers}
            names = [f"ranker-{i}" for i in range(len(have) + want) if f"ranker-{i}" not in taken]
            hosts = [r.host for r in have]  # new rankers go where the plan put rankers
            new = [
                dataclasses.replace(
                    have[0], name=name, host=hosts[i % len(hosts)], port=0, metrics_port=0
                )
                for i, name in enumerate(names[: want - len(have)])
            ]
            self._add("ranker", new, lambda role: self.mapping.get(role.host))
            self.plan.rankers.extend(new)
            self._note(f"rankers {len(have)} -> {want}: added {', '.join(r.name for r in new)}")
        elif want < len(have):
            gone = have[want:]
            for role in reversed(gone):
                self._retire(role.name)
            self.plan.rankers = have[:want]
            self._note(f"rankers {len(have)} -> {want}: removed {', '.join(r.name for r in gone)}")

    def _scale_replicas(self, want: int) -> None:
        groups: dict[int, list] = {}
        for s in self.plan.shards:
            groups.setdefault(s.group, []).append(s)
        for g, members in groups.items():
            if want > len(members):
                taken = {s.name for s in self.plan.shards}
                names = [f"shard-{g}-{i}" for i in range(len(members) + want)]
                new = [
                    dataclasses.replace(members[0], name=name, port=0, metrics_port=0)
                    for name in [n for n in names if n not in taken][: want - len(members)]
                ]
                self._add("shard", new, lambda role: None)
                self.plan.shards.extend(new)
            elif want < len(members):
                for role in reversed(members[want:]):
                    self._retire(role.name)
                    self.plan.shards.remove(role)
        self._note(f"replicas -> {want} per range group")

    # -- stopping ------------------------------------------------------------------------------
    def stop(self) -> dict[str, int]:
        """Routers first, then shards and rankers; each process SIGTERM, SIGKILL after the
        plan's stop timeout. Returns each role's exit code."""
        self.stopping.set()
        codes: dict[str, int] = {}
        timeout = self.plan.supervision.stop_timeout_s
        with self.lock:
            for kinds in (("router",), ("shard", "ranker")):
                batch = [(n, p.actor) for n, p in self.placed.items() if p.kind in kinds]
                codes |= stop_role_hosts(batch, timeout)
            self.placed.clear()
        return codes
