"""A plan's roles as the supervisor's ChildSpecs: each role's command line and the routers'
JSON. Shared by every runner that starts processes (local, testbed); what differs between
them is only where a role listens and how its command is wrapped: a `Binding`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from cleave.launch.supervisor import ChildSpec, find_executable, python_argv
from cleave.settings import IncastConfig, RankerConfig, ServeConfig, ShardConfig, flags
from cleave.settings.addresses import listen_host, socket_path

if TYPE_CHECKING:
    from cleave.plan import Plan, Ranker, Router, Shard


class Binding:
    """Where a runner puts each role: addresses and ports, chosen before anything starts. A
    port 0 is bound by the role itself, which says which (the supervisor takes it from
    there); a restarted role comes back on the ports it had."""

    def listen(self, role: Shard | Ranker) -> str:
        """The role's --listen address (cleave.settings.addresses): `HOST:PORT` (port 0: it
        binds one), `mptcp:HOST:PORT`, `unix:PATH` or `shm:PATH`."""
        raise NotImplementedError

    def metrics_port(self, role: Shard | Ranker) -> int:
        """Its /metrics, /ready, /live port on the listen address's host (loopback for a Unix
        socket): the plan's here; a runner that picks ports for 0 overrides it."""
        return role.metrics_port

    def http(self, router: Router) -> tuple[str, int]:
        """The router's client address and port (0: it binds one); /ready and /live there."""
        raise NotImplementedError

    def control_port(self, role: Ranker) -> int:
        """Its incast control port on the listen address's host (docs/traffic.md): the
        plan's here; a runner that picks ports for 0 overrides it."""
        return role.control_port

    def wrap(self, role: Shard | Ranker | Router, argv: list[str]) -> list[str]:
        """The command that runs `argv` where the role's host is (a namespace, say)."""
        return argv


def _url_host(host: str) -> str:
    """A bound host as a URL's: a wildcard is probed on loopback; IPv6 in brackets."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def probe_base(listen: str, port: int) -> str:
    """The base URL of a shard's or ranker's probes: its metrics port on its listen host."""
    return f"http://{_url_host(listen_host(listen))}:{port}"


def client_url(host: str, port: int, tls: bool = False) -> str:
    """A router's client URL (https when it serves TLS: docs/security.md)."""
    return f"{'https' if tls else 'http'}://{_url_host(host)}:{port}"


def control_address(listen: str, port: int) -> str:
    """A ranker's control address: its control port on its listen host (loopback for a Unix
    socket; control is always TCP)."""
    host = listen_host(listen)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def rankers_choose(plan: Plan) -> bool:
    """Whether the plan's rankers would choose their dense dtype among several the bundle
    approves (docs/bundle.md, "Chosen where it runs"): then the first one chooses for all."""
    from cleave.bundle.manifest import read, served_dtypes

    asks = any(r.dense_dtype == "auto" for r in plan.rankers)
    return asks and len(served_dtypes(read(plan.bundle_path()))) > 1


def pin_dense_dtype(rankers: list[ChildSpec], dtype: str) -> None:
    """Every ranker (and each one's restarts) serves `dtype`, the one the first chose: a
    request's scores depend neither on which ranker answers it nor on a restart."""
    if not dtype:
        return
    for spec in rankers:
        argv = list(spec.argv)
        for i, word in enumerate(argv[:-1]):
            if word == "--dense-dtype" and argv[i + 1] == "auto":
                argv[i + 1] = dtype
        spec.argv = argv


def activation_bytes(rankers: list[ChildSpec]) -> int:
    """The largest memory per batch row the rankers measured (0: none did): the batch cap
    must hold on every ranker."""
    return max((int(spec.reported.get("activation", 0)) for spec in rankers), default=0)


def _before_start(address: str):
    path = socket_path(address)
    if path is None:
        return None
    return lambda: path.unlink(missing_ok=True)  # a killed child leaves its socket


class RoleSpecs:
    """Turns a checked plan's roles into ChildSpecs under one Binding. `runtime` holds the
    routers' JSON files (`<router name>.json`)."""

    def __init__(self, plan: Plan, binding: Binding, runtime: Path):
        self.plan = plan
        self.binding = binding
        self.runtime = runtime
        self.bundle = plan.bundle_path().resolve()
        self.control: dict[str, str] = {}  # ranker name -> control address (incast control)

    def _spec(self, role, argv: list[str], address: str, metrics_port: int) -> ChildSpec:
        return ChildSpec(
            role.name,
            self.binding.wrap(role, argv),
            address,
            _before_start(address),
            probe=probe_base(address, metrics_port),
        )

    def shard_specs(self) -> list[ChildSpec]:
        specs = []
        for shard in self.plan.shards:
            address = self.binding.listen(shard)
            metrics_port = self.binding.metrics_port(shard)
            rows = ",".join(f"{t}={a}:{b}" for t, (a, b) in shard.ranges.items())
            argv = [
                find_executable("cleave-shard"),
                "--bundle",
                str(self.bundle),
                "--listen",
                address,
                "--rows",
                rows,
                "--metrics-port",
                str(metrics_port),
                *flags(shard, ShardConfig),  # --threads, --queue, --dram-budget (docs/tiers.md)
            ]
            if shard.ssd_tables:  # the plan's placement across tiers
                argv += ["--ssd-tables", ",".join(shard.ssd_tables)]
            if shard.profile:  # relative to the plan file, as the bundle is
                source = self.plan.source
                base = source.parent if source is not None else Path(".")
                argv += ["--profile", str(base / shard.profile)]
            if shard.state_dir:  # docs/tiers.md, "Updates"; relative to the plan file
                source = self.plan.source
                base = source.parent if source is not None else Path(".")
                argv += ["--state-dir", str(base / shard.state_dir)]
            specs.append(self._spec(shard, argv, address, metrics_port))
        return specs

    def ranker_specs(self) -> list[ChildSpec]:
        specs = []
        for r in self.plan.rankers:
            address = self.binding.listen(r)
            metrics_port = self.binding.metrics_port(r)
            argv = python_argv(
                "ranker",
                "--bundle",
                str(self.bundle),
                "--listen",
                address,
                "--metrics-port",
                str(metrics_port),
                *flags(r, RankerConfig),
            )
            if self.plan.mode == "monolithic":
                argv.append("--monolithic")
            elif self.measures_activation():
                argv.append("--measure-activation")
            if self.plan.incast_control and self.plan.mode != "monolithic":
                port = self.binding.control_port(r)
                self.control[r.name] = control_address(address, port)
                argv += ["--incast-control", "--control-port", str(port), *flags(r, IncastConfig)]
            spec = self._spec(r, argv, address, metrics_port)
            spec.forkable = True
            specs.append(spec)
        return specs

    def measures_activation(self) -> bool:
        """Whether the rankers measure their memory per batch row at start: an adaptive cache
        needs it and the plan does not give it (docs/cache.md, "Budget")."""
        r = self.plan.router
        return r.cache == "adaptive" and not r.activation_bytes_per_sample

    def router_specs(self, shards: list[ChildSpec], rankers: list[ChildSpec]) -> list[ChildSpec]:
        """One per router; call after the shards and rankers are ready."""
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
            path = self._router_config(
                router,
                routes,
                [spec.address for spec in rankers],
                {
                    spec.address: self.control[spec.name]
                    for spec in rankers
                    if spec.name in self.control
                },
                activation_bytes(rankers),
            )
            argv = [find_executable("cleave-router"), str(path)]
            specs.append(
                ChildSpec(
                    router.name,
                    self.binding.wrap(router, argv),
                    self._http(router),
                    probe=self.url(router),
                )
            )
        return specs

    def monolith_spec(self) -> ChildSpec:
        """The monolithic baseline: the whole model and the router in one process, ready
        when its router's /ready is."""
        (ranker,) = self.ranker_specs()
        (router,) = self.plan.routers
        path = self._router_config(router, [], [])  # the process fills in its own ranker
        argv = [*ranker.argv, "--with-router", str(path)]
        return ChildSpec(
            "monolith", argv, self._http(router), ranker.before_start, probe=self.url(router)
        )

    def url(self, router: Router) -> str:
        """The router's client URL (its probes are there too)."""
        return client_url(*self.binding.http(router), tls=bool(self.plan.router.tls_cert))

    def _router_config(
        self,
        router: Router,
        routes: list[dict],
        rankers: list[str],
        ranker_control: dict[str, str] | None = None,
        activation: int = 0,
    ) -> Path:
        from cleave.settings.router_json import router_config

        host, port = self.binding.http(router)
        s = self.plan.supervision
        config = ServeConfig(
            name=self.plan.name,
            host=host,
            http_port=port,
            grpc_port=router.grpc_port,
            monolithic=self.plan.mode == "monolithic",
            router_held=self.plan.mode == "router-held",
            ready_timeout_s=s.ready_timeout_s,
            stop_timeout_s=s.stop_timeout_s,
            router=self.plan.router,
        )
        path = self.config_path(router.name)
        values = router_config(self.plan.name, self.bundle, config, routes, rankers)
        if self.plan.rankers:  # the plan's own: the smallest, which the cap must not exceed
            values["ranker_max_batch"] = min(r.max_batch for r in self.plan.rankers)
        if activation and not values.get("activation_bytes_per_sample"):
            values["activation_bytes_per_sample"] = activation
        if ranker_control:  # incast control (docs/traffic.md): a grant before large payloads
            values["incast_control"] = True
            values["incast_threshold_bytes"] = self.plan.incast_threshold_bytes
            values["ranker_control"] = ranker_control
        path.write_text(json.dumps(values, indent=1))
        return path

    def config_path(self, router: str) -> Path:
        return self.runtime / f"{router}.json"

    def _http(self, router: Router) -> str:
        host, port = self.binding.http(router)
        return f"http {host}:{port}"
