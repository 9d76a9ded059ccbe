"""`cleave partition --model PKG.MODULE:FACTORY -o BUNDLE_DIR`."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from cleave.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        metavar="PKG.MODULE:FACTORY",
        help="a function returning (model, example_inputs), example_inputs a tuple of the "
        "forward's positional arguments",
    )
    parser.add_argument("-o", "--output", required=True, metavar="BUNDLE_DIR")
    parser.add_argument(
        "--table-dtype",
        default="float32",
        choices=["float32", "float16", "int8_rowwise", "int8"],
        help="storage type of the embedding tables (int8 = int8_rowwise)",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing BUNDLE_DIR")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def load_factory(spec: str):
    """Resolves PKG.MODULE:FACTORY and calls it; checks that it returns (model, inputs)."""
    import torch

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--model expects PKG.MODULE:FACTORY, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UsageError(f"--model {spec}: cannot import module {module_name!r}: {err}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"--model {spec}: module {module_name!r} has no callable {attr!r}")
    try:
        result = factory()
    except Exception as err:
        raise UsageError(
            f"--model {spec}: the factory raised {type(err).__name__}: {err}"
        ) from None
    if not (
        isinstance(result, tuple)
        and len(result) == 2
        and isinstance(result[0], torch.nn.Module)
        and isinstance(result[1], tuple)
    ):
        got = type(result).__name__
        if isinstance(result, tuple):
            got = f"tuple({', '.join(type(x).__name__ for x in result)})"
        raise UsageError(
            f"--model {spec}: the factory must return (torch.nn.Module, tuple of forward "
            f"arguments), got {got}"
        )
    return result


def run(args: argparse.Namespace) -> int:
    from cleave.partitioner import partition

    model, example = load_factory(args.model)
    dtype = "int8_rowwise" if args.table_dtype == "int8" else args.table_dtype
    bundle = partition(model, example, table_dtype=dtype)
    path = bundle.save(args.output, overwrite=args.force)
    summary = bundle.summary()
    if args.json:
        json.dump({"bundle": str(path), **summary}, sys.stdout, indent=1)
        print()
    else:
        print_summary(path, summary)
    return 0


def print_summary(path, summary: dict) -> None:
    tables = summary["tables"]
    print(f"bundle: {path}")
    print(
        f"sparse side: {len(tables)} tables, {summary['features']} features, "
        f"{_mib(summary['sparse_bytes'])}"
    )
    print(f"dense side:  {_mib(summary['dense_bytes'])} of weights")
    per_sample = sum(b["bytes"] for b in summary["boundary"] if b["per"] == "sample")
    print(f"boundary:    {len(summary['boundary'])} tensors, {per_sample} bytes per sample")
    groups: dict[tuple, list[str]] = {}  # tensors of one shape are listed together
    for b in summary["boundary"]:
        size = " x ".join([f"{b['bytes']} B", *b["times"]]) + f" per {b['per']}"
        groups.setdefault((str(b["shape"]), size), []).append(b["name"])
    for (shape, size), names in groups.items():
        label = names[0] if len(names) == 1 else f"{len(names)} x ({names[0]} ... {names[-1]})"
        print(f"  {label:<44} {shape:<16} {size}")
    if summary["shared_inputs"]:
        print(f"shared inputs (looked up once per request): {', '.join(summary['shared_inputs'])}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
