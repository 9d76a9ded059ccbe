"""Runners execute a deployment plan (docs/plan.md, "Runners"): `RUNNERS[name](**options)`
gives a `Runner`. A Kubernetes runner is to join this registry."""

from cleave.runners.base import Runner
from cleave.runners.local import LocalRunner
from cleave.runners.ray import RayRunner
from cleave.runners.testbed import TestbedRunner

RUNNERS: dict[str, type[Runner]] = {
    "local": LocalRunner,
    "testbed": TestbedRunner,
    "ray": RayRunner,
}

__all__ = ["RUNNERS", "LocalRunner", "RayRunner", "Runner", "TestbedRunner"]
