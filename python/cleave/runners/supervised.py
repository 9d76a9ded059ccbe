"""The part shared by runners whose roles are processes started from here (local, testbed):
start them in order under one Supervisor, gated on their ready lines; watch; stop."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cleave.launch.supervisor import Child, Supervisor
from cleave.runners.base import Runner
from cleave.runners.roles import Binding, RoleSpecs, learn_address

if TYPE_CHECKING:
    from cleave.plan import Plan


class SupervisedRunner(Runner):
    """Subclasses say where roles go (`bind`) and tear down what they made (`release`)."""

    def __init__(self, log=None):
        self.log = log or sys.stderr
        self.supervisor = Supervisor(log=self.log)
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
        specs = RoleSpecs(plan, self.bind(plan, plan_dir), plan_dir)
        timeout = plan.supervision.ready_timeout_s
        if plan.mode == "monolithic":
            routers = self.supervisor.start([specs.monolith_spec()], timeout)
        else:
            shards, rankers = specs.shard_specs(), specs.ranker_specs()
            # Shards and rankers load in parallel; the routers need their addresses.
            for child in self.supervisor.start(shards + rankers, timeout):
                learn_address(child.spec, child.ready_line)
            routers = self.supervisor.start(specs.router_specs(shards, rankers), timeout)
        urls = []
        for router, child in zip(plan.routers, routers, strict=True):
            words = child.ready_line.split()
            urls.append(words[1] if len(words) > 1 else "")
            specs.pin_http_port(router.name, urls[-1])
            child.spec.address = f"http {urls[-1].removeprefix('http://')}"  # port 0 learnt
        mode = "monolithic" if plan.mode == "monolithic" else f"{len(plan.shards)} shards"
        self._say(f"model {plan.name!r}, {mode}, {len(plan.rankers)} rankers")
        self._print_metrics(self.supervisor.children, [r.name for r in plan.routers], urls)
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
        try:
            print(f"cleave serve: {message}", file=self.log, flush=True)
        except (ValueError, OSError):  # our stderr is gone; the deployment goes on
            pass

    def _print_metrics(self, children: list[Child], routers: list[str], urls: list[str]) -> None:
        """Where each role's /metrics, /ready and /live are: from the ready lines."""
        where = [
            f"{c.spec.name} {word.removeprefix('metrics=')}"
            for c in children
            for word in c.ready_line.split()
            if word.startswith("metrics=")
        ]
        where += [f"{name} {url}" for name, url in zip(routers, urls, strict=True)]
        self._say(f"metrics: {', '.join(where)}")
