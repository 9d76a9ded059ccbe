"""`cleave scale NAME --rankers R [--replicas K]`: resize a running Ray deployment (docs/ray.md).
Finds the deployment's controller in its Ray namespace and asks it to add or remove rankers or
shard replicas; new roles are ready before the routers get them, removed ones are drained
first. Prints every role after, one a line."""

from __future__ import annotations

import argparse

from cleave.errors import UsageError
from cleave.runners.ray import connect, namespace
from cleave.runners.ray_actors import CONTROLLER

SCALE_TIMEOUT_S = 600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="the deployment's name (its plan's `name`, or --name)")
    parser.add_argument("--ray-address", help="the Ray head's HOST:PORT (default $RAY_ADDRESS)")
    parser.add_argument("--rankers", type=int, help="rankers wanted")
    parser.add_argument("--replicas", type=int, help="replicas wanted of every shard range")


def run(args: argparse.Namespace) -> int:
    if args.rankers is None and args.replicas is None:
        raise UsageError("expected --rankers R and/or --replicas K, got neither")
    for flag, value in (("--rankers", args.rankers), ("--replicas", args.replicas)):
        if value is not None and value < 1:
            raise UsageError(f"{flag}: expected at least 1, got {value}")
    ray = connect(args.ray_address, args.name, existing=True)
    try:
        try:
            controller = ray.get_actor(CONTROLLER)
        except ValueError:
            raise UsageError(
                f"no deployment {args.name!r} on this Ray cluster (namespace "
                f"{namespace(args.name)}); is `cleave serve --runner ray` running it?"
            ) from None
        try:
            status = ray.get(
                controller.scale.remote(args.rankers, args.replicas), timeout=SCALE_TIMEOUT_S
            )
        except ray.exceptions.RayTaskError as err:
            raise UsageError(f"scaling {args.name!r} failed: {err.cause or err}") from None
        for name, role in sorted(status["roles"].items()):
            print(f"{name} {role['kind']} {role['address']}", flush=True)
        return 0
    finally:
        ray.shutdown()
