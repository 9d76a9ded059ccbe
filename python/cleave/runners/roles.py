"""A plan's roles as the supervisor's ChildSpecs: each role's command line and the routers'
JSON. Shared by every runner that starts processes (local, testbed); what differs between
them is only where a role listens and how its command is wrapped: a `Binding`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cleave.launch.config import ServeConfig
from cleave.launch.supervisor import ChildSpec, python_argv

if TYPE_CHECKING:
    from cleave.plan import Plan, Ranker, Router, Shard


class Binding:
    """Where a runner puts each role. The defaults are this machine's loopback; runners
    override what differs."""

    def listen(self, role: Shard | Ranker) -> str:
        """The role's --listen address: `HOST:PORT` (port 0: the child picks one and says which
        in its ready line) or `unix:PATH`."""
        raise NotImplementedError

    def metrics_port(self, role: Shard | Ranker) -> int:
        """Its /metrics, /ready, /live port (on the listen address's host); 0: it picks one."""
        return role.metrics_port

    def http(self, router: Router) -> tuple[str, int]:
        """The router's client address and port."""
        raise NotImplementedError

    def wrap(self, role: Shard | Ranker | Router, argv: list[str]) -> list[str]:
        """The command that runs `argv` where the role's host is (a namespace, say)."""
        return argv


def _before_start(address: str):
    if not address.startswith("unix:"):
        return None
    path = Path(address.removeprefix("unix:"))
    return lambda: path.unlink(missing_ok=True)  # a killed child leaves its socket


class RoleSpecs:
    """Turns a checked plan's roles into ChildSpecs under one Binding. `runtime` holds the
    routers' JSON files (`<router name>.json`)."""

    def __init__(self, plan: Plan, binding: Binding, runtime: Path):
        self.plan = plan
        self.binding = binding
        self.runtime = runtime
        self.bundle = plan.bundle_path().resolve()

    def _spec(self, role, argv: list[str], address: str) -> ChildSpec:
        return ChildSpec(role.name, self.binding.wrap(role, argv), address, _before_start(address))

    def shard_specs(self) -> list[ChildSpec]:
        specs = []
        for shard in self.plan.shards:
            address = self.binding.listen(shard)
            rows = ",".join(f"{t}={a}:{b}" for t, (a, b) in shard.ranges.items())
            argv = python_argv(
                "shard",
                "--bundle",
                str(self.bundle),
                "--listen",
                address,
                "--threads",
                str(shard.threads),
                "--rows",
                rows,
                "--metrics-port",
                str(self.binding.metrics_port(shard)),
            )
            specs.append(self._spec(shard, argv, address))
        return specs

    def ranker_specs(self) -> list[ChildSpec]:
        specs = []
        for r in self.plan.rankers:
            address = self.binding.listen(r)
            argv = python_argv(
                "ranker",
                "--bundle",
                str(self.bundle),
                "--listen",
                address,
                "--device",
                r.device,
                "--threads",
                str(r.threads),
                "--max-batch",
                str(r.max_batch),
                "--max-wait-ms",
                str(r.max_wait_ms),
                "--max-queue",
                str(r.max_queue),
                "--metrics-port",
                str(self.binding.metrics_port(r)),
            )
            if self.plan.mode == "monolithic":
                argv.append("--monolithic")
            if not r.cuda_graphs:
                argv.append("--no-cuda-graphs")
            specs.append(self._spec(r, argv, address))
        return specs

    def router_specs(self, shards: list[ChildSpec], rankers: list[ChildSpec]) -> list[ChildSpec]:
        """One per router; call after the shards and rankers are ready (their addresses are
        then known, ports learnt from ready lines included)."""
        address = {spec.name: spec.address for spec in shards}
        routes = []
        for shard in self.plan.shards:
            # Every replica is a route: identical ranges at several addresses form a replica
            # group, and the router spreads lookups over its healthy replicas and fails over
            # between them (docs/serving.md, "Replicas and membership").
            routes += [
                {"table": t, "row_start": a, "row_end": b, "addr": address[shard.name]}
                for t, (a, b) in shard.ranges.items()
            ]
        specs = []
        for router in self.plan.routers:
            path = self._router_config(router, routes, [spec.address for spec in rankers])
            argv = [sys.executable, "-m", "cleave.launch.router", str(path)]
            specs.append(
                ChildSpec(router.name, self.binding.wrap(router, argv), self._http(router))
            )
        return specs

    def monolith_spec(self) -> ChildSpec:
        """The monolithic baseline: the whole model and the router in one process."""
        (ranker,) = self.ranker_specs()
        (router,) = self.plan.routers
        path = self._router_config(router, [], [])  # the process fills in its own ranker
        argv = [*ranker.argv, "--with-router", str(path)]
        return ChildSpec("monolith", argv, self._http(router), ranker.before_start)

    def _router_config(self, router: Router, routes: list[dict], rankers: list[str]) -> Path:
        from cleave.launch.router import router_config

        host, port = self.binding.http(router)
        s = self.plan.supervision
        config = ServeConfig(
            name=self.plan.name,
            host=host,
            http_port=port,
            monolithic=self.plan.mode == "monolithic",
            ready_timeout_s=s.ready_timeout_s,
            stop_timeout_s=s.stop_timeout_s,
            router=self.plan.router,
        )
        path = self.config_path(router.name)
        path.write_text(
            json.dumps(
                router_config(self.plan.name, self.bundle, config, routes, rankers), indent=1
            )
        )
        return path

    def config_path(self, router: str) -> Path:
        return self.runtime / f"{router}.json"

    def pin_http_port(self, router: str, url: str) -> None:
        """The router bound an ephemeral port: a restarted router must come back on it, or
        clients lose the deployment."""
        port = int(url.rsplit(":", 1)[1])
        path = self.config_path(router)
        config = json.loads(path.read_text())
        config["http_port"] = port
        path.write_text(json.dumps(config, indent=1))

    def _http(self, router: Router) -> str:
        host, port = self.binding.http(router)
        return f"http {host}:{port}"


def learn_address(spec: ChildSpec, ready_line: str) -> None:
    """A TCP child bound port 0: keep the port it got, so a restart binds the same one."""
    words = ready_line.split()
    if spec.address.endswith(":0") and len(words) > 1:
        actual = words[1]
        spec.argv[spec.argv.index(spec.address)] = actual
        spec.address = actual
