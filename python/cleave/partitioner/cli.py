"""`cleave partition --model PKG.MODULE:FACTORY -o BUNDLE_DIR`."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from cleave.errors import UsageError
from cleave.partitioner.accuracy import REFERENCE_SAMPLES
from cleave.settings.choices import DENSE_DTYPES, TABLE_DTYPE_SHORT_NAMES, TABLE_DTYPES


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
        choices=[*TABLE_DTYPES, *TABLE_DTYPE_SHORT_NAMES],
        help="storage type of the embedding tables (int8 = int8_rowwise, int4 = int4_rowwise)",
    )
    parser.add_argument(
        "--dense-dtype",
        choices=list(DENSE_DTYPES),
        help="precision the dense program is served at (default float32); a reduced one is "
        "refused when it moves AUC or scores past the limits on the labelled set",
    )
    parser.add_argument(
        "--dense-dtypes",
        metavar="D,D,...",
        help="instead of --dense-dtype: the precisions a ranker may choose among where it runs "
        "(the fastest there), e.g. float32,bfloat16,int8; float32 always, each reduced one "
        "approved when it passes the accuracy check, recorded as refused when not",
    )
    parser.add_argument(
        "--labelled",
        metavar="PKG.MODULE:FUNCTION",
        help="a function returning [(forward args, labels), ...] to measure a reduced dense "
        "dtype's accuracy on (default for the reference models: their request generator's "
        f"{REFERENCE_SAMPLES} labelled samples)",
    )
    parser.add_argument(
        "--max-auc-drop", type=float, default=0.001, help="largest AUC change allowed"
    )
    parser.add_argument(
        "--score-tolerance",
        type=float,
        default=0.02,
        help="largest change of any output value allowed",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing BUNDLE_DIR")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def _resolve(spec: str, flag: str, what: str):
    """PKG.MODULE:NAME -> the callable it names."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"{flag} expects PKG.MODULE:{what}, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UsageError(f"{flag} {spec}: cannot import module {module_name!r}: {err}") from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise UsageError(f"{flag} {spec}: module {module_name!r} has no callable {attr!r}")
    return function


def _call(function, spec: str, flag: str):
    try:
        return function()
    except Exception as err:
        raise UsageError(f"{flag} {spec}: it raised {type(err).__name__}: {err}") from None


def load_factory(spec: str):
    """Resolves PKG.MODULE:FACTORY and calls it; checks that it returns (model, inputs)."""
    import torch

    result = _call(_resolve(spec, "--model", "FACTORY"), spec, "--model")
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


def reference_entry(spec: str):
    """The reference model (cleave.models.MODELS) whose factory `spec` names, or None."""
    from cleave.models import MODELS

    factory = _resolve(spec, "--model", "FACTORY")
    return next((e for e in MODELS.values() if e.factory is factory), None)


def load_labelled(args: argparse.Namespace):
    """(labelled set or None, a typical request's forward args or None)."""
    entry = reference_entry(args.model)
    typical = entry.generator().batch(100) if entry else None
    if args.labelled:
        labelled = _call(
            _resolve(args.labelled, "--labelled", "FUNCTION"), args.labelled, "--labelled"
        )
        if not isinstance(labelled, list) or not labelled:
            raise UsageError(
                f"--labelled {args.labelled}: expected a non-empty list of (forward args, "
                f"labels), got {type(labelled).__name__}"
            )
        return labelled, typical
    if reduced_dtypes(args) == [] or entry is None:
        return None, typical
    return entry.generator().labelled(REFERENCE_SAMPLES, 256), typical


def dense_dtypes(args: argparse.Namespace) -> list[str] | None:
    """--dense-dtypes as a checked list (None without it); UsageError with --dense-dtype."""
    if args.dense_dtypes is None:
        return None
    if args.dense_dtype is not None:
        raise UsageError(
            f"--dense-dtype {args.dense_dtype} and --dense-dtypes {args.dense_dtypes}: "
            "expected one of them (one dtype, or the list a ranker chooses among)"
        )
    from cleave.bundle.precision import check_dtypes

    try:
        return check_dtypes(args.dense_dtypes)
    except UsageError as err:
        raise UsageError(f"--dense-dtypes {args.dense_dtypes!r}: {err}") from None


def reduced_dtypes(args: argparse.Namespace) -> list[str]:
    listed = dense_dtypes(args) or [args.dense_dtype or "float32"]
    return [d for d in listed if d != "float32"]


def run(args: argparse.Namespace) -> int:
    from cleave.partitioner import AccuracyLimits, partition

    listed = dense_dtypes(args)  # bad input refused before the model is loaded
    model, example = load_factory(args.model)
    dtype = TABLE_DTYPE_SHORT_NAMES.get(args.table_dtype, args.table_dtype)
    labelled, typical = load_labelled(args)
    bundle = partition(
        model,
        example,
        table_dtype=dtype,
        dense_dtype=args.dense_dtype or "float32",
        dense_dtypes=listed,
        labelled=labelled,
        limits=AccuracyLimits(args.max_auc_drop, args.score_tolerance),
        typical_inputs=typical,
    )
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
    dense = f"{_mib(summary['dense_bytes'])} of weights, served as {summary['dense_dtype']}"
    if summary["dense_dtypes"]:
        dense = f"{_mib(summary['dense_bytes'])} of weights, served as the ranker chooses:"
    print(f"dense side:  {dense}")
    for dtype, entry in (summary["dense_dtypes"] or {}).items():
        if not entry["approved"]:
            print(f"  {dtype:<9} refused: {entry['refused']}")
            continue
        cost = f"{entry['dense_us_per_sample']:.3g} us per sample on one thread here"
        a = entry.get("accuracy")
        moved = f", AUC {a['auc_delta']:+.5f}, scores within {a['max_score_diff']:.3g}" if a else ""
        print(f"  {dtype:<9} approved: {cost}{moved}")
    if summary["accuracy"]:
        a = summary["accuracy"]
        print(
            f"accuracy:    AUC {a['auc']:.5f} vs {a['auc_float32']:.5f} in float32 "
            f"({a['auc_delta']:+.5f}), scores within {a['max_score_diff']:.3g}, "
            f"on {a['samples']} labelled samples"
        )
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
    batched = summary["batched"]
    if batched and batched["program"]:
        print("requests share ranker batches: per-request inputs expanded to their rows")
    elif batched:
        print(f"requests run one per ranker batch: {batched['reason']}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
