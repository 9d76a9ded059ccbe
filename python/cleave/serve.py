"""`cleave serve BUNDLE`: one deployment on this machine — S embedding shards, R rankers and
one router, each a process, started in that order and gated on readiness, supervised, and
stopped cleanly on SIGINT/SIGTERM. With --monolithic: the whole model and the router in one
process (the baseline). `cleave serve --plan PLAN [--runner local|testbed]` executes a
deployment plan instead. docs/serving.md describes it.

One code path: BUNDLE and its flags become `local_plan(bundle, config)`, and a runner
(cleave.runners, docs/plan.md "Runners") turns any plan's roles into supervised processes."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from cleave.errors import UsageError
from cleave.launch.supervisor import ChildFailed
from cleave.settings import (
    QUEUE_POLICIES,
    RANKER_DENSE_DTYPES,
    TABLE_LAYOUTS,
    TRANSPORTS,
    RouterConfig,
    ServeConfig,
    config_file,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "bundle",
        nargs="?",
        help="bundle directory (cleave partition's output), or a model repository of "
        "MODEL/VERSION/ bundles (docs/repository.md); or --plan",
    )
    parser.add_argument("--plan", help="deployment plan (docs/plan.md) to run instead of BUNDLE")
    parser.add_argument(
        "--runner", choices=["local", "testbed", "ray"], default="local", help="what runs the roles"
    )
    parser.add_argument("--ray-address", help="ray runner: the Ray head's HOST:PORT")
    parser.add_argument("--url-file", help="write the routers' URLs here, one a line, once ready")
    parser.add_argument(
        "--link-gbit", type=float, help="testbed runner: host link rate, Gbit/s (default 1.0)"
    )
    parser.add_argument(
        "--racks",
        type=int,
        help="testbed runner: the plan's hosts in R racks of equal size (docs/testbed.md, 'Racks')",
    )
    parser.add_argument(
        "--rack-mode",
        choices=["tor", "pool"],
        help="testbed runner with --racks: each host's own NIC (tor, default) or its rack's (pool)",
    )
    parser.add_argument("--config", help="TOML file (docs/serving.md); flags override it")
    parser.add_argument("--http-port", type=int, help="client port; 0: ephemeral (default)")
    parser.add_argument(
        "--grpc-port", type=int, help="KServe v2 gRPC port (default: no gRPC); 0: ephemeral"
    )
    parser.add_argument("--tls-cert", help="PEM certificate chain: TLS on REST and gRPC")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--auth-token-file", help="file with the bearer token clients must send (REST, gRPC)"
    )
    parser.add_argument("--host", help="client address to bind (default 127.0.0.1)")
    parser.add_argument("--name", help="model name in the URLs (default: bundle directory name)")
    parser.add_argument("--shards", type=int, help="embedding shard processes (default 1)")
    parser.add_argument(
        "--table-layout",
        choices=TABLE_LAYOUTS.names,
        help="shards hold row ranges of every table (rows, default) or whole tables (tables)",
    )
    parser.add_argument("--rankers", type=int, help="ranker processes (default 1)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], help="ranker device")
    parser.add_argument(
        "--dense-dtype",
        choices=RANKER_DENSE_DTYPES.names,
        help="the rankers' dense precision, one the bundle approves (default auto: the "
        "fastest here when it approves several)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads per ranker (default: the cores the bundle's measured demand gives "
        "the dense side; all of them with --monolithic)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="compile the dense program with TorchInductor before ready (CPU; cached)",
    )
    parser.add_argument(
        "--no-shared-batching",
        dest="shared_batching",
        action="store_false",
        default=None,
        help="run a shared-input model one request per batch (default: joined when the "
        "bundle has a batched program)",
    )
    parser.add_argument(
        "--eager-model",
        metavar="MODEL.pt",
        help="with --monolithic: run this torch.save'd model eagerly, the eager baseline",
    )
    parser.add_argument("--max-batch", type=int, help="ranker batch rows at most")
    parser.add_argument("--max-wait-ms", type=float, help="ranker batching wait")
    parser.add_argument(
        "--queue",
        type=QUEUE_POLICIES.parse("--queue"),
        choices=QUEUE_POLICIES.names,
        help="order waiting requests start in at shards and rankers (default fifo; "
        "docs/serving.md, Queue policies)",
    )
    parser.add_argument("--transport", choices=TRANSPORTS.names, help="internal sockets")
    parser.add_argument(
        "--fail-stop",
        action="store_true",
        default=None,
        help="stop the deployment when a child dies (default: restart it with backoff)",
    )
    parser.add_argument(
        "--monolithic", action="store_true", default=None, help="serve the original model whole"
    )
    parser.add_argument(
        "--router-held",
        action="store_true",
        default=None,
        help="the router holds every table and looks rows up in-process (no shard processes)",
    )


def _apply_flags(config: ServeConfig, args: argparse.Namespace) -> None:
    top = {
        "http_port": args.http_port,
        "grpc_port": args.grpc_port,
        "host": args.host,
        "name": args.name,
        "shards": args.shards,
        "table_layout": args.table_layout,
        "rankers": args.rankers,
        "transport": args.transport,
        "fail_stop": args.fail_stop,
        "monolithic": args.monolithic,
        "router_held": args.router_held,
    }
    ranker = {
        "device": args.device,
        "dense_dtype": args.dense_dtype,
        "threads": args.threads,
        "compile": args.compile,
        "shared_batching": args.shared_batching,
        "eager_model": args.eager_model,
        "max_batch": args.max_batch,
        "max_wait_ms": args.max_wait_ms,
    }
    for key, value in top.items():
        if value is not None:
            setattr(config, key, value)
    for key, value in ranker.items():
        if value is not None:
            setattr(config.ranker, key, value)
    if args.queue is not None:
        config.shard.queue = config.ranker.queue = args.queue
    _apply_security(config.router, args)


def _apply_security(router: RouterConfig, args: argparse.Namespace) -> None:
    """--tls-cert, --tls-key, --auth-token-file: with a bundle or a plan alike."""
    for key in ("tls_cert", "tls_key", "auth_token_file"):
        value = getattr(args, key, None)
        if value is not None:
            setattr(router, key, value)


class Deployment:
    """What `cleave serve BUNDLE` runs, as a plan (kept for tools that ask for its ranges)."""

    def __init__(self, bundle: Path, config: ServeConfig, runtime: Path):
        from cleave.plan import local_plan

        self.plan = local_plan(bundle, config)
        self.runtime = runtime
        self.name = self.plan.name
        self.ranges = [s.ranges for s in self.plan.shards]


# Flags that shape a deployment: a plan already says all of it.
_LAYOUT_FLAGS = (
    "config",
    "shards",
    "table_layout",
    "rankers",
    "device",
    "dense_dtype",
    "threads",
    "compile",
    "shared_batching",
    "eager_model",
    "max_batch",
    "max_wait_ms",
    "queue",
    "transport",
    "monolithic",
    "router_held",
)


def _plan_from_args(args: argparse.Namespace):
    """(the plan to run, checked; the routers' client address for the local runner): --plan's
    file, or BUNDLE and its flags as local_plan. A plan holds no real address (docs/plan.md),
    so the config's `host` travels beside it."""
    from cleave.plan import load_plan, local_plan

    if (args.bundle is None) == (args.plan is None):
        raise UsageError(
            "expected exactly one of BUNDLE or --plan PLAN, got "
            + ("both" if args.bundle else "neither")
        )
    if args.bundle is not None:
        bundle = Path(args.bundle)
        if not bundle.is_dir():
            raise UsageError(f"bundle {bundle} is not a directory")
        config = config_file.load(args.config)
        _apply_flags(config, args)
        config.check()
        # local_plan reads the manifest: BundleError if it is bad.
        return local_plan(bundle.resolve(), config), config.host
    given = [f"--{k.replace('_', '-')}" for k in _LAYOUT_FLAGS if getattr(args, k) is not None]
    if given:
        raise UsageError(
            f"{', '.join(given)}: not with --plan (the plan says it); "
            "expected only --runner, --http-port, --grpc-port, --tls-cert, --tls-key, "
            "--auth-token-file, --host (local runner), --name, "
            "--fail-stop, --url-file, --link-gbit, --racks, --rack-mode, --ray-address"
        )
    plan = load_plan(args.plan)
    _apply_security(plan.router, args)
    if args.name is not None:
        plan.name = args.name
    if args.fail_stop is not None:
        plan.supervision.fail_stop = args.fail_stop
    if args.http_port is not None:  # one port per router: P, P+1, ... (0: each picks one)
        for i, router in enumerate(plan.routers):
            router.http_port = args.http_port + i if args.http_port else 0
    if args.grpc_port is not None:  # the same for gRPC
        for i, router in enumerate(plan.routers):
            router.grpc_port = args.grpc_port + i if args.grpc_port else 0
    for warning in plan.validate():  # against its bundle, or each version's (a repository plan)
        print(f"cleave serve: warning: {warning}", file=sys.stderr, flush=True)
    return plan, args.host


def _runner_options(args: argparse.Namespace, host: str | None) -> dict:
    if args.ray_address is not None and args.runner != "ray":
        raise UsageError("--ray-address: only with --runner ray")
    racked = args.racks is not None or args.rack_mode is not None
    if racked and args.runner != "testbed":
        raise UsageError("--racks, --rack-mode: only with --runner testbed")
    if args.runner == "ray":
        if args.host is not None or args.link_gbit is not None:
            raise UsageError("--host, --link-gbit: not with --runner ray (routers bind their node)")
        return {"address": args.ray_address}
    if args.runner == "testbed":
        if args.host is not None:  # routers bind their emulated host's address
            raise UsageError(
                "--host: not with --runner testbed (routers bind their host's testbed address)"
            )
        if args.rack_mode is not None and args.racks is None:
            raise UsageError("--rack-mode: only with --racks")
        return {
            "link_gbit": 1.0 if args.link_gbit is None else args.link_gbit,
            "racks": args.racks,
            "rack_mode": args.rack_mode or "tor",
        }
    if args.link_gbit is not None:  # only emulated links have a rate
        raise UsageError("--link-gbit: only with --runner testbed")
    return {"host": host} if host is not None else {}


def say_ready(urls: list[str], out=None) -> None:
    """One `ready URL` line a router on stdout, each in one write: a reader that takes our
    stdout and stderr through one pipe (ServeProcess) must never find a role's log line inside
    it, as it can when print() writes the text and its newline in two calls (it does, with
    PYTHONUNBUFFERED)."""
    out = out or sys.stdout
    for url in urls:
        out.write(f"ready {url}\n")
        out.flush()


def write_url_file(path: Path, urls: list[str]) -> None:
    """Atomically: a temporary file beside it, renamed into place."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{url}\n" for url in urls))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _repository_from_args(args: argparse.Namespace):
    """`cleave serve REPO`: a directory of MODEL/VERSION/ bundles (docs/repository.md)."""
    from cleave.repository.deployment import RepositoryDeployment

    refused = [
        flag
        for flag, value in (("--name", args.name), ("--link-gbit", args.link_gbit))
        if value is not None
    ]
    if args.runner != "local":
        refused.append(f"--runner {args.runner}")
    if refused:
        raise UsageError(
            f"{', '.join(refused)}: not with a model repository (its directories name the "
            "models; the local runner serves it; on other hosts: write a repository plan with "
            "`cleave plan REPO`, then `cleave serve --plan`)"
        )
    config = config_file.load(args.config)
    _apply_flags(config, args)
    config.check()
    return RepositoryDeployment(Path(args.bundle).resolve(), config)


def _repository_plan_deployment(args: argparse.Namespace, plan, options: dict):
    """`cleave serve --plan` of a repository plan (docs/plan.md, "Repository plans"): the
    versions it carries on its roles, on this machine, the testbed or Ray."""
    from cleave.repository.deployment import RepositoryDeployment
    from cleave.repository.hosts import LocalHosts, TestbedHosts
    from cleave.repository.placement import PlanPlacement, plan_config
    from cleave.runners.local import LOOPBACK

    config = plan_config(plan, options.get("host", LOOPBACK))
    if args.runner == "ray":
        from cleave.repository.ray_hosts import RayHosts

        hosts = RayHosts(plan, options["address"])
    elif args.runner == "testbed":
        hosts = TestbedHosts(plan, options["link_gbit"], options["racks"], options["rack_mode"])
    else:
        hosts = LocalHosts(config.host, config.http_port)
    placement = PlanPlacement(plan, config)
    return RepositoryDeployment(plan.bundle_path().resolve(), config, None, placement, hosts)


def _deployment_from_args(args: argparse.Namespace):
    """(what runs, how to start it): a runner and a plan, or a model repository."""
    from cleave.bundle.repository import is_repository
    from cleave.runners import RUNNERS

    if args.bundle is not None and args.plan is None and is_repository(Path(args.bundle)):
        deployment = _repository_from_args(args)
        return deployment, deployment.start
    plan, host = _plan_from_args(args)
    options = _runner_options(args, host)
    if is_repository(plan.bundle_path()):
        deployment = _repository_plan_deployment(args, plan, options)
        return deployment, deployment.start
    runner = RUNNERS[args.runner](**options)
    return runner, lambda runtime: runner.start(plan, runtime)


def run(args: argparse.Namespace) -> int:
    url_file = Path(args.url_file) if args.url_file else None
    if url_file is not None and not url_file.parent.is_dir():
        raise UsageError(f"--url-file {url_file}: directory {url_file.parent} does not exist")
    runner, start = _deployment_from_args(args)
    stopping = threading.Event()  # a signal asked us to stop: a failed start is then no error

    def on_signal(*_) -> None:
        stopping.set()
        runner.request_stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    runtime = Path(tempfile.mkdtemp(prefix="cleave-serve-"))
    wrote = False
    try:
        urls = start(runtime)
        if url_file is not None:  # before the ready lines: whoever reads them finds it
            write_url_file(url_file, urls)
            wrote = True
        say_ready(urls)
        code = runner.watch()
    except ChildFailed as err:
        if stopping.is_set():
            code = 0
        else:
            print(f"cleave serve: {err}", file=sys.stderr, flush=True)
            code = 1
    finally:
        runner.stop()
        shutil.rmtree(runtime, ignore_errors=True)
        if wrote:  # its URLs are dead now: a later reader must not find them
            url_file.unlink(missing_ok=True)
    return code
