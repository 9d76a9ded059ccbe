"""`cleave ranker`: run a bundle's dense program (or, with --monolithic, the whole model) for
routers, over the internal frame protocol."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from cleave.errors import UsageError
from cleave.settings import IncastConfig, RankerConfig, choice_list, default, doc
from cleave.settings.addresses import listen_host


def _flag(cls: type, name: str, more: str = "") -> dict:
    """argparse's default, help and choices for setting `name` of `cls` (cleave.settings)."""
    value, choices = default(cls, name), choice_list(cls, name)
    text = " ".join(t for t in (doc(cls, name), more) if t)
    options = {"default": value, "help": f"{text}; default {value}"}
    if choices is not None:
        flag = "--" + name.replace("_", "-")
        options |= {"type": choices.parse(flag), "choices": choices.names}
    return options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", required=True, help="bundle directory")
    parser.add_argument(
        "--listen", required=True, help="host:port, mptcp:host:port, unix:/path or shm:/path"
    )
    parser.add_argument("--device", **_flag(RankerConfig, "device"))
    parser.add_argument("--dense-dtype", **_flag(RankerConfig, "dense_dtype"))
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--max-batch", type=int, **_flag(RankerConfig, "max_batch"))
    parser.add_argument("--max-wait-ms", type=float, **_flag(RankerConfig, "max_wait_ms"))
    parser.add_argument(
        "--max-queue",
        type=int,
        **_flag(RankerConfig, "max_queue", "(the router retries it on another ranker)"),
    )
    parser.add_argument(
        "--queue", **_flag(RankerConfig, "queue", "fifo (arrival) or edf (earliest deadline)")
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="HTTP port for /live, /ready, /metrics on the listen host (0 picks one)",
    )
    parser.add_argument(
        "--control-port",
        type=int,
        default=0,
        help="incast control port on the listen host (docs/traffic.md): routers ask it before "
        "sending a large payload; 0 (default): no incast control, or with --incast-control a "
        "free port, named on the ready line (control=ADDR)",
    )
    parser.add_argument(
        "--incast-control",
        action="store_true",
        help="serve incast control (implied by a non-zero --control-port)",
    )
    parser.add_argument(
        "--incast-window-bytes", type=int, **_flag(IncastConfig, "incast_window_bytes")
    )
    parser.add_argument(
        "--incast-adaptive",
        action="store_true",
        help="the window follows congestion on this host's data connections (TCP_INFO), from "
        "--incast-window-bytes up to 64 times it in steps of it (docs/traffic.md)",
    )
    parser.add_argument("--incast-order", **_flag(IncastConfig, "incast_order"))
    parser.add_argument(
        "--link-gbit",
        type=float,
        **_flag(IncastConfig, "link_gbit", "now + SLO - M/B, in Gbit/s"),
    )
    parser.add_argument(
        "--monolithic",
        action="store_true",
        help="run the whole model on RANK_FULL requests (the baseline)",
    )
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run CUDA batches eagerly")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the dense program with TorchInductor (CPU) before reporting ready",
    )
    parser.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="keep compiled programs here (default: $XDG_CACHE_HOME/cleave/inductor)",
    )
    parser.add_argument(
        "--no-shared-batching",
        action="store_true",
        help="run a shared-input model one request per batch even when the bundle has a "
        "batched program",
    )
    parser.add_argument(
        "--measure-activation",
        action="store_true",
        help="measure the dense program's memory per batch row at start and report it on the "
        "ready line (the router's adaptive cache shares a budget with the batches)",
    )
    parser.add_argument("--eager-model", metavar="MODEL.pt", **_flag(RankerConfig, "eager_model"))
    parser.add_argument(
        "--with-router",
        metavar="CONFIG.json",
        help="also run the router (its JSON config) in this process: the one-process "
        "monolithic baseline of `cleave serve --monolithic`",
    )


def _init_logging() -> None:
    """Like the executables' logs: stderr, level from CLEAVE_LOG (default info)."""
    import logging
    import os

    value = os.environ.get("CLEAVE_LOG", "info")
    # A Rust filter ("cleave_router=debug,info") names its default level without a target.
    bare = [d.strip() for d in value.split(",") if d.strip() and "=" not in d]
    level = (bare[-1] if bare else "info").upper()
    level = {"TRACE": "DEBUG", "WARN": "WARNING", "OFF": "CRITICAL"}.get(level, level)
    if not isinstance(logging.getLevelName(level), int):
        raise UsageError(f"CLEAVE_LOG={value!r}: expected a level: debug, info, warn or error")
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def run(args: argparse.Namespace) -> int:
    _init_logging()
    if args.max_batch < 1:
        raise UsageError(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.max_queue < 1:
        raise UsageError(f"--max-queue must be at least 1, got {args.max_queue}")
    if args.max_wait_ms < 0:
        raise UsageError(f"--max-wait-ms must be >= 0, got {args.max_wait_ms}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be at least 1, got {args.threads}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise UsageError(f"--metrics-port must be 0..65535, got {args.metrics_port}")
    if not 0 <= args.control_port <= 65535:
        raise UsageError(f"--control-port must be 0..65535, got {args.control_port}")
    if args.incast_window_bytes < 1:
        raise UsageError(
            f"--incast-window-bytes must be at least 1, got {args.incast_window_bytes}"
        )
    if not args.link_gbit > 0:
        raise UsageError(f"--link-gbit must be > 0, got {args.link_gbit}")
    if args.eager_model and not args.monolithic:
        raise UsageError("--eager-model runs the whole model: it needs --monolithic")

    from cleave._native import FrameServer, WireError
    from cleave.ranker.program import load_ranker

    batcher = load_ranker(
        args.bundle,
        source=None,
        monolithic=args.monolithic,
        device=args.device,
        threads=args.threads,
        max_batch=args.max_batch,
        max_wait_s=args.max_wait_ms / 1000,
        cuda_graphs=not args.no_cuda_graphs,
        max_queue=args.max_queue,
        queue=args.queue,
        compile=args.compile,
        compile_cache=args.compile_cache,
        shared_batching=not args.no_shared_batching,
        eager_model=args.eager_model,
        dense_dtype=args.dense_dtype,
        measure_activation=args.measure_activation,
    )
    try:
        server = FrameServer(args.listen)
    except (OSError, ValueError, WireError) as err:
        raise UsageError(f"cannot listen on {args.listen!r}: {err}") from None
    batcher.source = server
    # The one-process baseline has no network between router and ranker: nothing to control.
    use_control = (args.control_port or args.incast_control) and not args.with_router
    control = _control(args, server) if use_control else None
    if control is not None:
        from cleave.ranker.control import ControlledSource

        batcher.source = ControlledSource(server, control)
    if args.with_router:
        return _serve_with_router(batcher, server, args.with_router)

    probes = _probes(batcher, server.address, args.metrics_port, control)
    stop = threading.Event()

    def on_signal(*_):
        if probes:
            probes.problems.append("stopping")
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    device = batcher.executor.device
    mode = "monolithic" if args.monolithic else "dense"
    if not batcher.signature.batchable:
        print(f"one request per batch: {batcher.signature.why_not}", file=sys.stderr, flush=True)
    metrics = f" metrics={probes.address}" if probes else ""
    if control is not None:
        metrics += f" control={control.address}"
    if batcher.activation_bytes:  # the launcher gives the router the largest one
        metrics += f" activation={batcher.activation_bytes}"
    dtype = batcher.dense_choice.dtype  # the launcher settles the deployment's from it
    print(f"ready {server.address} device={device} mode={mode} dtype={dtype}{metrics}", flush=True)
    batcher.serve_forever(stop)
    if control is not None:
        batcher.source.close()  # its thread reads the server: stop it first
    server.close()
    if control is not None:
        control.close()
    if probes:
        probes.close()
    _report(batcher)
    return 0


def _probes(batcher, address: str, port: int | None, control=None):
    """/live, /ready and /metrics on the listen address's host (loopback for Unix sockets)."""
    if port is None:
        return None
    from cleave.ranker.probes import Probes

    host = listen_host(address)
    try:
        return Probes(batcher, host, port, control)
    except OSError as err:
        raise UsageError(f"--metrics-port {port}: cannot listen on {host}: {err}") from None


ADAPTIVE_MAX_STEPS = 64  # the adaptive window's ceiling, in steps of its starting size


def _control(args: argparse.Namespace, server):
    """The incast control port on the listen address's host (loopback for Unix sockets)."""
    from cleave._native import AdaptiveWindow, IncastScheduler
    from cleave.ranker.control import CongestionMeter, ControlServer

    address = server.address
    host = listen_host(address)
    link = args.link_gbit * 1e9 / 8
    window = args.incast_window_bytes
    # B in the start-by deadline is learnt from the payloads' transfers, from --link-gbit on.
    scheduler = IncastScheduler(window, args.incast_order, link, True, measure_rate=True)
    adaptive = meter = None
    if args.incast_adaptive:
        adaptive = AdaptiveWindow(window, ADAPTIVE_MAX_STEPS * window, window)
        meter = CongestionMeter(server.receiver_stats, link)
    try:
        return ControlServer(host, args.control_port, scheduler, adaptive, meter)
    except OSError as err:
        raise UsageError(
            f"--control-port {args.control_port}: cannot listen on {host}: {err}"
        ) from None


def _serve_with_router(batcher, server, config_path: str) -> int:
    """The router on this (main) thread, where it handles SIGTERM/SIGINT and prints its ready
    line; the batching loop on a second thread, fed through this process's own socket."""
    from cleave._native import run_router

    try:
        config = json.loads(Path(config_path).read_text())
    except (OSError, ValueError) as err:
        raise UsageError(f"--with-router {config_path}: {err}") from None
    config["rankers"] = [server.address]
    stop = threading.Event()
    loop = threading.Thread(target=batcher.serve_forever, args=(stop,), name="ranker")
    loop.start()
    try:
        run_router(json.dumps(config))
    except (ValueError, RuntimeError) as err:
        print(f"cleave router: {err}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop.set()
        loop.join()
        server.close()
        _report(batcher)
    return 0


def _report(batcher) -> None:
    s = batcher.stats
    print(
        f"ranker stopped: {s.requests} requests in {s.batches} batches, "
        f"{s.dropped_deadline} past deadline, {s.cancelled} cancelled, {s.overloaded} refused "
        f"(queue full), {s.bad_requests} malformed, {s.failed} failed, "
        f"{s.dropped_late} dropped as unable to make their deadline",
        file=sys.stderr,
    )
