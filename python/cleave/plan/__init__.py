"""Deployment plans (docs/plan.md): a pure, serialisable description of which role runs on
which logical host, that runners (local processes, the testbed, Ray, Helm) execute."""

from cleave.plan.cluster import emulated_hosts, load_cluster, this_machine
from cleave.plan.files import dump_plan, load_plan, plan_from_dict, plan_to_dict, save_plan
from cleave.plan.planner import layout, local_plan, make_plan
from cleave.plan.schema import FORMAT, VERSION, Host, Plan, Ranker, Router, Shard, Supervision

__all__ = [
    "FORMAT",
    "VERSION",
    "Host",
    "Plan",
    "Ranker",
    "Router",
    "Shard",
    "Supervision",
    "dump_plan",
    "emulated_hosts",
    "layout",
    "load_cluster",
    "load_plan",
    "local_plan",
    "make_plan",
    "plan_from_dict",
    "plan_to_dict",
    "save_plan",
    "this_machine",
]
