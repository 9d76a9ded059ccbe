"""The part shared by runners whose roles are processes started from here (local, testbed):
start them in order under one Supervisor, each gated on its `/ready` probe; watch; stop."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cleave.errors import UsageError
from cleave.launch.supervisor import Child, ChildSpec, Supervisor, port_of
from cleave.runners.base import Runner
from cleave.runners.roles import Binding, RoleSpecs, pin_dense_dtype, rankers_choose

if TYPE_CHECKING:
    from cleave.plan import Plan


# What every role reads its internal secret from (crates/cleave-wire/src/auth.rs).
INTERNAL_SECRET = "CLEAVE_INTERNAL_SECRET"


def read_internal_secret(name: str) -> str | None:
    """The secret in the variable the plan names (`router.internal_secret_env`); None when the
    plan names none."""
    if not name:
        return None
    value = os.environ.get(name, "")
    if not value:
        raise UsageError(
            f"router.internal_secret_env names {name!r}, but that environment variable is "
            "unset or empty: set it to the deployment's internal secret"
        )
    return value


def share_internal_secret(name: str) -> None:
    """Copies the secret in the variable the plan names into the one every role reads; the
    children inherit it. Nothing when the plan names none."""
    value = read_internal_secret(name)
    if value is not None:
        os.environ[INTERNAL_SECRET] = value


def keep_router_ports(config: Path, router: ChildSpec) -> None:
    """A router given port 0 bound one: its JSON takes that port, so that a restart comes back
    on the URL the clients have (its gRPC port too)."""
    values = json.loads(config.read_text())
    bound = {
        "http_port": port_of(router.probe),
        "grpc_port": port_of(router.reported.get("grpc", "")),
    }
    kept = {key: port for key, port in bound.items() if values.get(key) == 0 and port}
    if kept:
        config.write_text(json.dumps(values | kept, indent=1))


def start_backends(
    supervisor: Supervisor, specs: RoleSpecs, timeout: float
) -> tuple[list[ChildSpec], list[ChildSpec]]:
    """Starts a plan's shards and rankers and waits until they are ready: (shards, rankers),
    at the addresses they bound (the supervisor read them from their ready lines)."""
    shards, rankers = specs.shard_specs(), specs.ranker_specs()
    # Shards and rankers load in parallel; the routers need them ready.
    if rankers_choose(specs.plan):  # the first ranker chooses the dense dtype for all
        supervisor.start(shards + rankers[:1], timeout)
        pin_dense_dtype(rankers, rankers[0].reported.get("dtype", ""))
        if len(rankers) > 1:
            supervisor.start(rankers[1:], timeout)
    else:
        supervisor.start(shards + rankers, timeout)
    for ranker in rankers:
        if ranker.name in specs.control and "control" in ranker.reported:
            specs.control[ranker.name] = ranker.reported["control"]
    return shards, rankers


class SupervisedRunner(Runner):
    """Subclasses say where roles go (`bind`) and tear down what they made (`release`)."""

    def __init__(self, log=None):
        self.log = log or sys.stderr
        self.supervisor = Supervisor(log=self.log, fork=True)
        self.plan: Plan | None = None
        self._stopped = False

    # -- what a subclass provides --------------------------------------------------------------
    def bind(self, plan: Plan, plan_dir: Path) -> Binding:
        """Make the hosts (if any) and say where each role goes."""
        raise NotImplementedError

    def release(self) -> None:
        """Remove what bind() made; called once, after every role stopped."""

    # -- the interface -------------------------------------------------------------------------
    def start(self, plan: Plan, plan_dir: Path) -> list[str]:
        self.plan = plan
        self.supervisor.fail_stop = plan.supervision.fail_stop
        try:
            return self._start(plan, plan_dir)
        except BaseException:
            self.stop()
            raise

    def _start(self, plan: Plan, plan_dir: Path) -> list[str]:
        share_internal_secret(plan.router.internal_secret_env)
        specs = RoleSpecs(plan, self.bind(plan, plan_dir), plan_dir)
        timeout = plan.supervision.ready_timeout_s
        if plan.mode == "monolithic":
            routers = self.supervisor.start([specs.monolith_spec()], timeout)
        else:
            shards, rankers = start_backends(self.supervisor, specs, timeout)
            routers = self.supervisor.start(specs.router_specs(shards, rankers), timeout)
        for router, child in zip(plan.routers, routers, strict=True):
            keep_router_ports(specs.config_path(router.name), child.spec)
        urls = [child.spec.probe for child in routers]  # each router's client URL
        mode = f"{len(plan.shards)} shards" if plan.mode == "disaggregated" else plan.mode
        self._say(f"model {plan.name!r}, {mode}, {len(plan.rankers)} rankers")
        self._print_metrics(self.supervisor.children)
        return urls

    def watch(self) -> int:
        assert self.plan is not None, "watch() before start()"
        return self.supervisor.watch(self.plan.supervision.ready_timeout_s)

    def request_stop(self) -> None:
        self.supervisor.request_stop()

    def stop(self) -> dict[str, int]:
        if self._stopped:
            return {}
        self._stopped = True
        timeout = self.plan.supervision.stop_timeout_s if self.plan else 10.0
        try:
            return self.supervisor.stop(timeout)
        finally:
            self.release()

    # -- messages ------------------------------------------------------------------------------
    def _say(self, message: str) -> None:
        self.supervisor.say(message)

    def _print_metrics(self, children: list[Child]) -> None:
        """Where each role's /metrics is (its /ready and /live beside it), one line a role,
        for an operator's scraper."""
        for child in children:
            self._say(f"metrics {child.spec.name} {child.spec.probe}/metrics")
