"""Runners execute a deployment plan (docs/plan.md, "Runners"): `RUNNERS[name](**options)`
gives a `Runner`. Ray and Kubernetes runners are to join this registry."""

from cleave.runners.base import Runner
from cleave.runners.local import LocalRunner
from cleave.runners.testbed import TestbedRunner

RUNNERS: dict[str, type[Runner]] = {"local": LocalRunner, "testbed": TestbedRunner}

__all__ = ["RUNNERS", "LocalRunner", "Runner", "TestbedRunner"]
