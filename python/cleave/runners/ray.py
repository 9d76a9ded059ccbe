"""The Ray runner (docs/ray.md): a plan's roles on a Ray cluster. `cleave serve --plan PLAN
--runner ray [--ray-address ADDR]` drives it: it connects, maps the plan's hosts to Ray nodes,
checks they have room, and hands the plan to a detached controller actor in the namespace
`cleave-NAME`, which starts every role on its node (ray_actors.py) and keeps it there. The
routers' URLs come back as with the other runners; `cleave scale NAME` finds the controller
later by its namespace."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from cleave.errors import UsageError
from cleave.launch.supervisor import ChildFailed, probe_ready
from cleave.runners.base import Runner
from cleave.runners.ray_actors import CONTROLLER, Controller, live_nodes, role_needs
from cleave.runners.supervised import read_internal_secret

if TYPE_CHECKING:
    from cleave.plan import Plan

HOST_LABEL = "cleave-host"
CONNECT_TIMEOUT_S = 5.0  # an unreachable --ray-address fails after this long, not Ray's minutes
STATUS_TIMEOUT_S = 30.0
WATCH_EVERY_S = 1.0


def namespace(name: str) -> str:
    """The Ray namespace of deployment `name`: later commands find its controller there."""
    return f"cleave-{name}"


def _import_ray():
    try:
        import ray
    except ImportError:
        raise UsageError(
            "--runner ray needs Ray: pip install 'cleave[ray]' (or make setup)"
        ) from None
    return ray


def _check_reachable(address: str) -> None:
    """A TCP connect to the head's GCS port, bounded: Ray's own connect retries for minutes."""
    if address == "auto":
        return
    if address.startswith("ray://"):
        raise UsageError(
            f"--ray-address {address}: Ray Client addresses are not supported; expected "
            "HOST:PORT of the head node's GCS (what `ray start --head` prints)"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise UsageError(f"--ray-address {address!r}: expected HOST:PORT, e.g. 10.0.0.5:6379")
    try:
        socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise UsageError(
            f"--ray-address {address}: no Ray cluster answers there ({err}) after "
            f"{CONNECT_TIMEOUT_S:.0f} s; start one (`ray start --head`) or pass its head's "
            "HOST:PORT"
        ) from None


def connect(address: str | None, name: str, existing: bool = False):
    """ray.init into the deployment's namespace, keeping our signal handlers (cleave serve
    stops the deployment on SIGTERM; Ray's driver would just exit). No address: $RAY_ADDRESS,
    else (`existing`) a cluster this machine runs in, else a Ray started here."""
    ray = _import_ray()
    address = address or os.environ.get("RAY_ADDRESS") or ("auto" if existing else None)
    if address:
        _check_reachable(address)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        ray.init(
            address=address,
            namespace=namespace(name),
            log_to_driver=True,
            include_dashboard=False if address is None else None,
            logging_level="warning",
        )
    except (ConnectionError, RuntimeError, ValueError) as err:
        if address == "auto":
            raise UsageError(
                "no Ray cluster runs on this machine; pass --ray-address HOST:PORT of its head "
                f"(or set $RAY_ADDRESS): {err}"
            ) from None
        raise UsageError(f"--ray-address {address}: cannot connect to Ray: {err}") from None
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    return ray


def map_hosts(plan: Plan, nodes: dict[str, dict]) -> dict[str, str]:
    """plan host -> node id. By the nodes' `cleave-host` label when any node carries one (then
    every plan host needs a node); else the plan's hosts are spread over the nodes in order,
    hosts with GPUs (rankers') onto GPU nodes first."""
    if not nodes:
        raise UsageError("the Ray cluster has no live node")
    labelled = {
        n["labels"][HOST_LABEL]: nid for nid, n in nodes.items() if HOST_LABEL in n["labels"]
    }
    if labelled:
        missing = [h.name for h in plan.hosts if h.name not in labelled]
        if missing:
            raise UsageError(
                f"plan hosts {', '.join(missing)}: no live Ray node has label "
                f"{HOST_LABEL}={missing[0]} (labelled: {', '.join(sorted(labelled))}); label a "
                f"node for each plan host (ray start --labels {HOST_LABEL}=NAME) or none at all"
            )
        return {h.name: labelled[h.name] for h in plan.hosts}
    ordered = sorted(nodes, key=lambda nid: (nodes[nid]["ip"], nid))
    gpu = [nid for nid in ordered if nodes[nid]["gpus"]]
    cpu = [nid for nid in ordered if not nodes[nid]["gpus"]] or ordered
    mapping, i, j = {}, 0, 0
    for host in plan.hosts:
        if host.gpus and gpu:
            mapping[host.name], i = gpu[i % len(gpu)], i + 1
        else:
            mapping[host.name], j = cpu[j % len(cpu)], j + 1
    return mapping


def check_capacity(plan: Plan, mapping: dict[str, str], nodes: dict[str, dict]) -> None:
    """UsageError naming each node whose roles need more CPUs or GPUs than it has: Ray would
    otherwise leave them pending forever."""
    need = defaultdict(lambda: [0.0, 0.0, []])
    roles = [("shard", s) for s in plan.shards] + [("ranker", r) for r in plan.rankers]
    for kind, role in roles + [("router", r) for r in plan.routers]:
        node = mapping[role.host]
        cpus, gpus = role_needs(kind, role, nodes[node]["gpus"])
        entry = need[node]
        entry[0] += cpus
        entry[1] += gpus
        entry[2].append(f"{role.name} on {role.host}")
    problems = []
    for node, (cpus, gpus, names) in need.items():
        have = nodes[node]
        for what, wanted, got in (("CPUs", cpus, have["cpus"]), ("GPUs", gpus, have["gpus"])):
            if wanted > got:
                problems.append(
                    f"Ray node {have['ip']} ({node[:8]}) has {got:.0f} {what}, its roles need "
                    f"{wanted:.0f} ({', '.join(names)})"
                )
    if problems:
        raise UsageError(
            "the plan needs more than the Ray cluster has: "
            + "; ".join(problems)
            + ". Add nodes or resources, or lower the roles' threads / use device cpu"
        )


class RayRunner(Runner):
    """`address`: the Ray head's HOST:PORT (`--ray-address`); None: $RAY_ADDRESS, else a Ray
    started for this deployment on this machine."""

    def __init__(self, address: str | None = None, log=None):
        self.address = address
        self.log = log or sys.stderr
        self.ray = None
        self.controller = None
        self.plan: Plan | None = None
        self.stopping = threading.Event()
        self._stopped = False

    def start(self, plan: Plan, plan_dir: Path) -> list[str]:
        self.plan = plan
        try:
            return self._start(plan)
        except BaseException:
            self.stop()
            raise

    def _start(self, plan: Plan) -> list[str]:
        if plan.mode == "monolithic" or plan.transport != "tcp":
            raise UsageError(
                f"{plan.where()}: the Ray runner runs disaggregated plans over TCP; got mode "
                f"{plan.mode!r}, transport {plan.transport!r} (use --runner local for these)"
            )
        plan.bundle = str(plan.bundle_path().resolve())  # every node sees the same path
        ray = self.ray = connect(self.address, plan.name)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = live_nodes(ray)
        mapping = map_hosts(plan, nodes)
        check_capacity(plan, mapping, nodes)
        try:
            ray.get_actor(CONTROLLER)
        except ValueError:
            pass
        else:
            raise UsageError(
                f"deployment {plan.name!r} already runs on this Ray cluster (namespace "
                f"{namespace(plan.name)}); stop it first or serve under another --name"
            )
        env = plan.router.admin_token_env
        token = os.environ.get(env) if env else None
        # Every role's host gets it in its environment: Ray's workers do not see this one's.
        secret = read_internal_secret(plan.router.internal_secret_env)
        # The controller shares the first router's node: a deployment that loses that node
        # is over anyway (its clients' URL is gone), so no other node's death can take it.
        home = mapping[plan.routers[0].host]
        self.controller = (
            ray.remote(Controller)
            .options(
                name=CONTROLLER,
                lifetime="detached",  # `cleave scale` finds it; stop() removes it
                num_cpus=0,
                max_concurrency=8,  # status and scale answer while it heals
                scheduling_strategy=NodeAffinitySchedulingStrategy(home, soft=False),
            )
            .remote(plan, mapping, nodes, token, secret)
        )
        self._say(
            "Ray nodes: "
            + ", ".join(f"{h}={nodes[nid]['ip']}({nid[:8]})" for h, nid in mapping.items())
        )
        urls = self._wait(self.controller.start.remote(), plan.supervision.ready_timeout_s * 3)
        status = self._wait(self.controller.status.remote(), STATUS_TIMEOUT_S)
        for url in urls:  # the routers as clients reach them
            ok, answer = probe_ready(f"{url}/ready")
            if not ok:
                raise ChildFailed(f"router at {url}: GET {url}/ready answered {answer}")
        self._say(f"model {plan.name!r}, {len(plan.shards)} shards, {len(plan.rankers)} rankers")
        for name, role in status["roles"].items():
            self._say(f"role {name} on Ray node {role['node']} ({nodes[role['node']]['ip']})")
            self._say(f"metrics {name} {role['probe']}/metrics")
        return urls

    def _wait(self, ref, timeout_s: float):
        """ray.get, giving up when request_stop() is called."""
        ray = self.ray
        deadline = timeout_s
        while deadline > 0:
            if self.stopping.is_set():
                raise ChildFailed("stopped while starting the deployment")
            ready, _ = ray.wait([ref], timeout=0.5)
            if ready:
                try:
                    return ray.get(ref)
                except ray.exceptions.RayTaskError as err:
                    cause = err.cause
                    if isinstance(cause, UsageError | ChildFailed):
                        raise cause from None
                    raise ChildFailed(str(cause or err)) from None
                except ray.exceptions.RayActorError as err:
                    raise ChildFailed(f"the deployment's controller died: {err}") from None
            deadline -= 0.5
        raise ChildFailed(f"the deployment was not ready after {timeout_s:.0f} s")

    def watch(self) -> int:
        assert self.controller is not None, "watch() before start()"
        ray = self.ray
        seen = 0
        while not self.stopping.wait(WATCH_EVERY_S):
            try:
                status = ray.get(self.controller.status.remote(), timeout=STATUS_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayActorError as err:
                self._say(f"the deployment's controller died; stopping: {err}")
                return 1
            for event in status["events"][seen:]:
                self._say(event)
            seen = len(status["events"])
            if status["failed"]:
                self._say(f"{status['failed']}; stopping the deployment")
                return 1
        return 0

    def request_stop(self) -> None:
        self.stopping.set()

    def stop(self) -> dict[str, int]:
        if self._stopped or self.ray is None:
            self._stopped = True
            return {}
        self._stopped = True
        ray, codes = self.ray, {}
        if self.controller is not None:
            timeout = self.plan.supervision.stop_timeout_s if self.plan else 10.0
            try:
                codes = ray.get(self.controller.stop.remote(), timeout=2 * timeout + 60)
            except ray.exceptions.RayError as err:
                self._say(f"stopping the roles: {err}")
            ray.kill(self.controller)
        ray.shutdown()
        return codes

    def _say(self, message: str) -> None:
        try:
            print(f"cleave serve: {message}", file=self.log, flush=True)
        except (ValueError, OSError):
            pass
