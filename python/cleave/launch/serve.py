"""`cleave serve BUNDLE`: one deployment on this machine — S embedding shards, R rankers and
one router, each a process, started in that order and gated on readiness, supervised, and
stopped cleanly on SIGINT/SIGTERM. With --monolithic: the whole model and the router in one
process (the baseline). docs/serving.md describes it."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from cleave.errors import BundleError, UsageError
from cleave.launch import config as config_io
from cleave.launch.supervisor import (
    ChildFailed,
    ChildSpec,
    Supervisor,
    install_signal_handlers,
    python_argv,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", help="bundle directory (cleave partition's output)")
    parser.add_argument("--config", help="TOML file (docs/serving.md); flags override it")
    parser.add_argument("--http-port", type=int, help="client port; 0: ephemeral (default)")
    parser.add_argument("--host", help="client address to bind (default 127.0.0.1)")
    parser.add_argument("--name", help="model name in the URLs (default: bundle directory name)")
    parser.add_argument("--shards", type=int, help="embedding shard processes (default 1)")
    parser.add_argument("--rankers", type=int, help="ranker processes (default 1)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], help="ranker device")
    parser.add_argument("--threads", type=int, help="torch threads per ranker")
    parser.add_argument("--max-batch", type=int, help="ranker batch rows at most")
    parser.add_argument("--max-wait-ms", type=float, help="ranker batching wait")
    parser.add_argument("--transport", choices=["unix", "tcp"], help="internal sockets")
    parser.add_argument(
        "--fail-stop",
        action="store_true",
        default=None,
        help="stop the deployment when a child dies (default: restart it with backoff)",
    )
    parser.add_argument(
        "--monolithic", action="store_true", default=None, help="serve the original model whole"
    )


def _apply_flags(config: config_io.ServeConfig, args: argparse.Namespace) -> None:
    top = {
        "http_port": args.http_port,
        "host": args.host,
        "name": args.name,
        "shards": args.shards,
        "rankers": args.rankers,
        "transport": args.transport,
        "fail_stop": args.fail_stop,
        "monolithic": args.monolithic,
    }
    ranker = {
        "device": args.device,
        "threads": args.threads,
        "max_batch": args.max_batch,
        "max_wait_ms": args.max_wait_ms,
    }
    for key, value in top.items():
        if value is not None:
            setattr(config, key, value)
    for key, value in ranker.items():
        if value is not None:
            setattr(config.ranker, key, value)


def read_manifest(bundle: Path) -> dict:
    """manifest.json, read without importing torch (the launcher never needs it)."""
    path = bundle / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise BundleError(f"{path}: not found; is {bundle} a Cleave bundle?") from None
    except (OSError, json.JSONDecodeError) as err:
        raise BundleError(f"{path}: cannot be read: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "cleave-bundle":
        raise BundleError(f"{path}: expected format 'cleave-bundle'")
    return manifest


def table_ranges(manifest: dict, shards: int) -> list[dict[str, tuple[int, int]]]:
    """Each table's rows cut into `shards` contiguous ranges: shard i holds rows
    [rows * i // S, rows * (i + 1) // S) of every table (empty ranges left out)."""
    plan: list[dict[str, tuple[int, int]]] = [{} for _ in range(shards)]
    for table in manifest["tables"]:
        rows = int(table["rows"])
        for i in range(shards):
            start, end = rows * i // shards, rows * (i + 1) // shards
            if end > start:
                plan[i][table["name"]] = (start, end)
    return plan


class Deployment:
    """The processes of one `cleave serve`, their addresses and the router's configuration."""

    def __init__(self, bundle: Path, config: config_io.ServeConfig, runtime: Path):
        self.bundle = bundle
        self.config = config
        self.runtime = runtime
        self.manifest = read_manifest(bundle)
        self.name = config.name or bundle.name
        ranges = [] if config.monolithic else table_ranges(self.manifest, config.shards)
        self.ranges = [r for r in ranges if r]  # more shards than rows in every table: fewer

    def _address(self, name: str) -> str:
        if self.config.transport == "unix":
            return f"unix:{self.runtime / name}.sock"
        return "127.0.0.1:0"  # the child picks a port and says which in its ready line

    def _before_start(self, address: str):
        if not address.startswith("unix:"):
            return None
        path = Path(address.removeprefix("unix:"))
        return lambda: path.unlink(missing_ok=True)  # a killed child leaves its socket

    def shard_specs(self) -> list[ChildSpec]:
        specs = []
        for i, ranges in enumerate(self.ranges):
            name, address = f"shard-{i}", self._address(f"shard-{i}")
            rows = ",".join(f"{t}={a}:{b}" for t, (a, b) in ranges.items())
            argv = python_argv(
                "shard",
                "--bundle",
                str(self.bundle),
                "--listen",
                address,
                "--threads",
                str(self.config.shard.threads),
                "--rows",
                rows,
                "--metrics-port",
                "0",
            )
            specs.append(ChildSpec(name, argv, address, self._before_start(address)))
        return specs

    def ranker_specs(self) -> list[ChildSpec]:
        c = self.config.ranker
        specs = []
        for i in range(self.config.rankers):
            name, address = f"ranker-{i}", self._address(f"ranker-{i}")
            argv = python_argv(
                "ranker",
                "--bundle",
                str(self.bundle),
                "--listen",
                address,
                "--device",
                c.device,
                "--threads",
                str(self.config.ranker_threads()),
                "--max-batch",
                str(c.max_batch),
                "--max-wait-ms",
                str(c.max_wait_ms),
                "--max-queue",
                str(c.max_queue),
                "--metrics-port",
                "0",
            )
            if self.config.monolithic:
                argv.append("--monolithic")
            if not c.cuda_graphs:
                argv.append("--no-cuda-graphs")
            specs.append(ChildSpec(name, argv, address, self._before_start(address)))
        return specs

    def router_spec(self, shards: list[ChildSpec], rankers: list[ChildSpec]) -> ChildSpec:
        routes = [
            {"table": table, "row_start": a, "row_end": b, "addr": spec.address}
            for spec, ranges in zip(shards, self.ranges, strict=True)
            for table, (a, b) in ranges.items()
        ]
        path = self._router_config(routes, [spec.address for spec in rankers])
        argv = [sys.executable, "-m", "cleave.launch.router", str(path)]
        return ChildSpec("router", argv, self._http())

    def monolith_spec(self) -> ChildSpec:
        """The monolithic baseline: the whole model and the router in one process."""
        (ranker,) = self.ranker_specs()
        path = self._router_config([], [])  # the process fills in its own ranker address
        argv = [*ranker.argv, "--with-router", str(path)]
        return ChildSpec("monolith", argv, self._http(), ranker.before_start)

    def _router_config(self, routes: list[dict], rankers: list[str]) -> Path:
        from cleave.launch.router import router_config

        config = router_config(self.name, self.bundle, self.config, routes, rankers)
        path = self.runtime / "router.json"
        path.write_text(json.dumps(config, indent=1))
        return path

    def pin_http_port(self, url: str) -> None:
        """The router bound an ephemeral port: a restarted router must come back on it, or
        clients lose the deployment."""
        port = int(url.rsplit(":", 1)[1])
        path = self.runtime / "router.json"
        config = json.loads(path.read_text())
        config["http_port"] = port
        path.write_text(json.dumps(config, indent=1))

    def _http(self) -> str:
        return f"http {self.config.host}:{self.config.http_port}"


def _learn_address(spec: ChildSpec, ready_line: str) -> None:
    """A TCP child bound port 0: keep the port it got, so a restart binds the same one."""
    words = ready_line.split()
    if spec.address.endswith(":0") and len(words) > 1:
        actual = words[1]
        spec.argv[spec.argv.index(spec.address)] = actual
        spec.address = actual


def _print_metrics(children, url: str) -> None:
    """Where each role's /metrics, /ready and /live are: from the ready lines."""
    where = [
        f"{c.spec.name} {word.removeprefix('metrics=')}"
        for c in children
        for word in c.ready_line.split()
        if word.startswith("metrics=")
    ]
    where.append(f"router {url}")
    print(f"cleave serve: metrics: {', '.join(where)}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    bundle = Path(args.bundle)
    if not bundle.is_dir():
        raise UsageError(f"bundle {bundle} is not a directory")
    config = config_io.load(args.config)
    _apply_flags(config, args)
    config.check()

    runtime = Path(tempfile.mkdtemp(prefix="cleave-serve-"))
    supervisor = Supervisor(fail_stop=config.fail_stop)
    install_signal_handlers(supervisor)
    try:
        deployment = Deployment(bundle.resolve(), config, runtime)
        if config.monolithic:
            (router,) = supervisor.start([deployment.monolith_spec()], config.ready_timeout_s)
        else:
            shards, rankers = deployment.shard_specs(), deployment.ranker_specs()
            # Shards and rankers load in parallel; the router needs their addresses.
            started = supervisor.start(shards + rankers, config.ready_timeout_s)
            for child in started:
                _learn_address(child.spec, child.ready_line)
            (router,) = supervisor.start(
                [deployment.router_spec(shards, rankers)], config.ready_timeout_s
            )
        url = router.ready_line.split()[1] if len(router.ready_line.split()) > 1 else ""
        deployment.pin_http_port(url)
        mode = "monolithic" if config.monolithic else f"{config.shards} shards"
        print(
            f"cleave serve: model {deployment.name!r}, {mode}, {config.rankers} rankers",
            file=sys.stderr,
            flush=True,
        )
        _print_metrics(supervisor.children, url)
        print(f"ready {url}", flush=True)
        code = supervisor.watch(config.ready_timeout_s)
    except ChildFailed as err:
        if supervisor.stopping.is_set():
            code = 0
        else:
            print(f"cleave serve: {err}", file=sys.stderr, flush=True)
            code = 1
    finally:
        supervisor.stop(config.stop_timeout_s)
        shutil.rmtree(runtime, ignore_errors=True)
    return code
