"""Which roles a repository deployment gives each model version, and on which logical hosts
(docs/repository.md, "Plans and runners"). `Served` asks a placement for a version's roles,
cuts them down to the tables no served version has, and starts them; the hosts (hosts.py)
say how they are bound.

* `LocalPlacement`: `cleave serve REPO`: the versions the models' policies select, each laid
  out as `cleave serve` lays out one bundle, on this machine.
* `PlanPlacement`: `cleave serve --plan` of a repository plan: the versions the plan carries on
  the roles it gives them; a version loaded later on the plan's hosts, by `place_version` with
  the plan's shape, as `cleave plan REPO` would have placed it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cleave.bundle.repository import model_policy
from cleave.plan import Plan, local_plan
from cleave.plan.repository import carried, name_roles, place_version, plan_shape, version_plan
from cleave.settings import RankerConfig, ServeConfig, ShardConfig


class LocalPlacement:
    def __init__(self, config: ServeConfig):
        self.config = config

    def initial(self, repo: Path, models: dict[str, dict[int, Path]]) -> list[tuple[str, int]]:
        """The versions served from the start."""
        return [(m, v) for m, vs in models.items() for v in model_policy(repo, m).select(list(vs))]

    def roles(self, model: str, version: int, bundle: Path) -> Plan:
        """The version's roles, named after it; not yet cut to its new tables."""
        return name_roles(local_plan(bundle, self.config), model, version)


class PlanPlacement:
    def __init__(self, plan: Plan, config: ServeConfig):
        self.plan = plan
        self.config = config
        self.carried = carried(plan)

    def initial(self, repo: Path, models: dict[str, dict[int, Path]]) -> list[tuple[str, int]]:
        return list(self.carried)  # `cleave plan --check` found each in the repository

    def roles(self, model: str, version: int, bundle: Path) -> Plan:
        if (model, version) in self.carried:
            return version_plan(self.plan, model, version)
        groups, replicas, rankers = plan_shape(self.plan)
        plan = place_version(
            bundle, model, version, self.plan.hosts, groups, replicas, rankers, self.config
        )
        # Its logical ports would repeat the carried roles' (make_plan numbers from one base):
        # 0, so that the runner picks ports free on each host.
        for role in [*plan.shards, *plan.rankers]:
            role.port = role.metrics_port = 0
        plan.transport = self.plan.transport
        plan.routers = []  # the deployment's one router is the plan's
        return plan


def plan_config(plan: Plan, host: str) -> ServeConfig:
    """The settings of a repository plan's deployment, as `cleave serve REPO` has them in its
    config: the router's and supervision's from the plan, a shard's and a ranker's from its
    first carried ones (what a version loaded later gets); `host`: the local runner's client
    address."""
    (router,) = plan.routers
    config = ServeConfig(
        name=plan.name,
        host=host,
        http_port=router.http_port,
        grpc_port=router.grpc_port,
        transport=plan.transport,
        fail_stop=plan.supervision.fail_stop,
        ready_timeout_s=plan.supervision.ready_timeout_s,
        stop_timeout_s=plan.supervision.stop_timeout_s,
        router=dataclasses.replace(plan.router),
    )
    if plan.shards:
        s = plan.shards[0]
        config.shard = ShardConfig(threads=s.threads, queue=s.queue, dram_budget=s.dram_budget)
    if plan.rankers:
        r = plan.rankers[0]
        config.ranker = RankerConfig(
            **{f.name: getattr(r, f.name) for f in dataclasses.fields(RankerConfig)}
        )
    return config
