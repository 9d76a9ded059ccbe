"""`cleave shard`: one embedding shard process. It serves lookups for some tables (and row
ranges) of a bundle over the internal protocol (docs/protocol.md), prints one line
"ready ADDRESS metrics=URL tables=NAME=START:END,..." once its tables are mapped, and stops
cleanly on SIGTERM/SIGINT after finishing the requests in flight.

Everything runs in Rust (`cleave._native.run_shard`) with the GIL released; this module only
parses the command line, so it never imports torch."""

from __future__ import annotations

import argparse

from cleave.errors import BundleError, UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", required=True, help="bundle directory (manifest.json, tables/)")
    parser.add_argument(
        "--tables", help="comma-separated tables to hold (default: all, or those named in --rows)"
    )
    parser.add_argument(
        "--rows",
        help="rows held: START:END (global ids, every table) or NAME=START:END,... per table",
    )
    parser.add_argument(
        "--listen", required=True, help="host:port (port 0 picks one) or unix:/path/to/socket"
    )
    parser.add_argument(
        "--metrics-port", type=int, help="HTTP port for /metrics, /ready, /live (0 picks one)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="lookup threads, an I/O thread included"
    )
    parser.add_argument(
        "--io-threads", type=int, default=1, help="threads that own connections and run lookups"
    )
    parser.add_argument(
        "--frame-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a started frame (or a new connection's HELLO) must arrive within this",
    )
    parser.add_argument(
        "--resident",
        action="store_true",
        help="copy tables into memory instead of mapping the files",
    )


def _print_ready(info: dict) -> None:
    print(f"ready {info['line']}", flush=True)


def run(args: argparse.Namespace) -> int:
    from cleave import _native

    tables = [t.strip() for t in args.tables.split(",") if t.strip()] if args.tables else None
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise UsageError(f"--metrics-port must be 0..65535, got {args.metrics_port}")
    try:
        _native.run_shard(
            args.bundle,
            args.listen,
            tables=tables,
            rows=args.rows,
            metrics_port=args.metrics_port,
            threads=args.threads,
            io_threads=args.io_threads,
            frame_timeout_s=args.frame_timeout,
            resident=args.resident,
            on_ready=_print_ready,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    except RuntimeError as err:
        raise BundleError(str(err)) from None
    return 0
