"""`cleave` command line. Each subcommand lives beside the role it drives and is imported
only when used, so `cleave shard` never pays for importing torch."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

from cleave.errors import CleaveError

# subcommand -> (module with add_arguments(parser) and run(args) -> int, one-line help)
COMMANDS = {
    "partition": ("cleave.partitioner.cli", "cut a PyTorch model into a bundle"),
    "shard": ("cleave.launch.shard", "serve embedding lookups for a bundle's tables"),
    "ranker": ("cleave.ranker.cli", "run the dense program for routers"),
    "serve": ("cleave.serve", "serve a bundle or a model repository on this machine"),
    "plan": ("cleave.plan.cli", "write or check a deployment plan: which role runs on which host"),
    "simulate": ("cleave.simulate.cli", "replay a cluster trace: fragmentation, GPUs, loaning"),
    "profile": ("cleave.sizing.profile", "measure what a bundle's request costs on this machine"),
    "size": ("cleave.sizing.cli", "the cheapest hosts for a rate at a p99, written as a plan"),
    "scale": ("cleave.runners.ray_scale", "add or remove rankers or shard replicas on Ray"),
    "update": ("cleave.update", "stage and switch a table's new rows on every live shard"),
    "rollout": ("cleave.repository.rollout", "send a share of a model's traffic to a version"),
    "rollback": ("cleave.repository.rollback", "end a canary, or return to the previous version"),
    "score": ("cleave.score.cli", "score a Parquet file in bulk over ranks, tables split"),
    "demo": ("cleave.demo", "partition, serve and load the Criteo-shaped model end to end"),
    "testbed": ("cleave.testbed.cli", "emulated multi-host network of namespaces on this machine"),
    "stream": ("cleave.stream.consumer", "apply row updates from a Kafka topic as they arrive"),
}
BENCHMARKS = {
    "lookup": ("cleave.bench.lookup", "pooled lookup rate vs PyTorch and the memory limit"),
    "shard": ("cleave.bench.shard", "shard latency and throughput over loopback"),
    "serve": ("cleave.bench.serve", "open-loop serving load, disaggregated vs monolithic"),
    "admission": ("cleave.bench.admission", "admission rules below capacity: adaptive vs estimate"),
    "scale": ("cleave.bench.scale", "goodput while `cleave scale` adds and removes rankers on Ray"),
    "incast": ("cleave.bench.incast", "many senders to one ranker: incast windows, EDF, credits"),
    "incast-serve": ("cleave.bench.incast_serve", "routers to one ranker, incast control off, on"),
    "rack": ("cleave.bench.rack", "a hot shard host on the rack testbed: ToR vs pooled NICs"),
    "tier": ("cleave.bench.tier", "tables larger than memory: SSD tier and caches vs DRAM, mmap"),
    "cache": (
        "cleave.bench.cache",
        "router embedding cache: off, fixed, adaptive",
    ),
    "size": (
        "cleave.sizing.benchmark",
        "cleave size's predictions against plans served on the testbed",
    ),
    "misses": ("cleave.bench.misses", "SSD-tier misses: read inline vs by miss workers"),
    "score": ("cleave.bench.score", "cleave score over ranks x lag x injected imbalance (BLS)"),
    "front-door": ("cleave.bench.front_door", "one request's cost, REST JSON vs binary tensors"),
    "refusal": ("cleave.bench.refusal", "the router's CPU per refused request, by body size"),
    "json-parse": ("cleave.bench.json_parse", "router JSON request parsing, scanner vs serde_json"),
    "idle-gap": ("cleave.bench.idle_gap", "the dense program after an idle gap vs back to back"),
    "repository": ("cleave.bench.repository", "a model repository's memory per loaded version"),
    "torchrec-quant": (
        "cleave.bench.torchrec_quant",
        "a TorchRec DLRM's score cost of int8/int4 tables, Cleave's vs TorchRec's quantization",
    ),
}

# Commands that start deployments, testbeds or Ray nodes for a while and are not servers
# themselves: SIGTERM unwinds them as Ctrl-C does, so what they started is stopped on the way
# out instead of outliving them (the serving roles handle SIGTERM their own way).
UNWIND_ON_SIGTERM = {"bench", "demo", "profile", "size"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own exit code is 2 as well
        self.print_usage(sys.stderr)
        self.exit(2, f"cleave: error: {message}\n")


def _add(subparsers, name: str, module: str, help_text: str, selected: bool) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(_module=module)
    # Arguments are declared by the module; import it only when this command runs.
    if selected:
        importlib.import_module(module).add_arguments(parser)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="cleave", description="Disaggregated DLRM serving.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (module, help_text) in COMMANDS.items():
        _add(sub, name, module, help_text, argv[:1] == [name])
    bench = sub.add_parser("bench", help="benchmarks that print JSON and a table")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True, parser_class=_Parser)
    for name, (module, help_text) in BENCHMARKS.items():
        _add(bench_sub, name, module, help_text, argv[:2] == ["bench", name])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["shard"]:  # cleave-shard parses its own flags (and --help)
        from cleave.launch.shard import exec_shard

        try:
            return exec_shard(argv[1:])
        except CleaveError as err:
            print(f"cleave shard: error: {err}", file=sys.stderr)
            return 2
    args = build_parser(argv).parse_args(argv)
    # Only Python's main thread may set a handler (a caller of main() in a thread keeps its own);
    # an in-process caller gets its handler back.
    unwind = (
        args.command in UNWIND_ON_SIGTERM and threading.current_thread() is threading.main_thread()
    )
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if unwind else None
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except CleaveError as err:
        print(f"cleave {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(*_) -> None:
    sys.exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
