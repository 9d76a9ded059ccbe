"""`cleave score BUNDLE --input DATA --output SCORES`: batch scoring of a Parquet file over
ranks with model-parallel tables (docs/score.md)."""

from __future__ import annotations

import argparse
import sys
import time

from cleave.errors import UsageError
from cleave.settings.choices import TABLE_LAYOUTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", help="the bundle directory (cleave partition)")
    parser.add_argument("--input", help="a Parquet file, or a directory of them: one row a sample")
    parser.add_argument("--output", help="the Parquet file to write (atomically)")
    parser.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="rank processes, the tables split among them (default: one, in this process)",
    )
    parser.add_argument(
        "--lag",
        type=int,
        default=0,
        help="iterations ranks may run apart (the bounded-lag alltoallv's K; 0: synchronous)",
    )
    parser.add_argument("--batch-size", type=int, default=1024, help="rows per batch")
    parser.add_argument(
        "--table-layout",
        choices=TABLE_LAYOUTS,
        default="tables",
        help="how ranks split the tables, as the planner splits them over shards: whole "
        "tables (default), or a row range of every table (for a table no rank can hold)",
    )
    parser.add_argument("--key", default=None, help="an input column copied to the output")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads per rank (default: the cores over the ranks)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds a rank waits for a silent peer before failing the job",
    )
    parser.add_argument(
        "--print-schema",
        action="store_true",
        help="print the input columns the model needs, and the output's",
    )
    # cleave bench score's injected imbalance (docs/score.md): KIND:SECONDS[:SEED]
    parser.add_argument("--inject", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=16, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from cleave.bundle import manifest as manifest_io
    from cleave.score.input import Schema

    if args.print_schema:
        print(Schema(manifest_io.read(args.bundle)).describe(args.key))
        return 0
    if not args.input or not args.output:
        raise UsageError("--input and --output are required (or --print-schema)")
    from cleave.score import job as score_job

    options = dict(
        bundle=args.bundle,
        input=args.input,
        output=args.output,
        lag=args.lag,
        batch_size=args.batch_size,
        table_layout=args.table_layout,
        key=args.key,
        threads=args.threads,
        timeout_s=args.timeout,
        chunk=args.chunk,
        inject=parse_inject(args.inject),
    )
    if args.ranks is None and score_job.under_torchrun():
        bar = ProgressBar(seen=1)
        done = score_job.run_torchrun(options, bar.update)
        if done:
            bar.close()
            print(describe(done[1], done[0]))
        return 0
    job, note = score_job.prepare(**options, ranks=args.ranks or 1)
    if note:
        print(note, file=sys.stderr, flush=True)
    done = min(job.rows, job.start * job.ranks * job.batch_size)  # a resumed job's, about
    bar = ProgressBar(done)
    summary = score_job.run(job, processes=args.ranks is not None, on_event=bar.update)
    bar.close()
    print(describe(summary, job))
    return 0


def parse_inject(text: str | None) -> dict:
    if not text:
        return {}
    kind, _, rest = text.partition(":")
    delay, _, seed = rest.partition(":")
    if kind not in ("random_delay", "straggler"):
        raise UsageError(f"--inject {text!r}: random_delay or straggler, then :SECONDS[:SEED]")
    return {"kind": kind, "delay_s": float(delay or 0), "seed": int(seed or 0)}


class ProgressBar:
    """Rows scored so far on stderr: redrawn in place on a terminal, a line per 10 % else.
    `ranks`: the ranks whose reports it sees (every one; under torchrun only rank 0's, whose
    rows it counts for all)."""

    def __init__(self, already: int = 0, seen: int | None = None):
        self.already, self.seen = already, seen
        self.done: dict[int, int] = {}
        self.began = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.shown = -1

    def update(self, rank: int, event: dict) -> None:
        if event["event"] != "batch" or (self.seen is not None and rank >= self.seen):
            return
        self.done[rank] = event["rows"]
        scale = event["ranks"] / self.seen if self.seen else 1
        total = event["total"]
        rows = min(total, self.already + int(sum(self.done.values()) * scale))
        tenth = 10 * rows // total
        if self.tty or tenth > self.shown:
            self.shown = tenth
            rate = (rows - self.already) / max(time.monotonic() - self.began, 1e-9)
            bar = "#" * (3 * tenth) + "." * (30 - 3 * tenth)
            end = "\r" if self.tty else "\n"
            print(
                f"[{bar}] {rows}/{total} rows, {rate:,.0f} rows/s",
                end=end,
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def describe(summary: dict, job) -> str:
    """The summary: rows, rows/s, and where each rank's time went."""
    lines = [
        f"scored {summary['rows']} rows into {job.output} in {summary['seconds']:.2f} s, "
        f"{summary['scoring_s']:.2f} s of it scoring ({summary['rows_per_s']:,.0f} rows/s over "
        f"{job.ranks} rank(s), lag {job.lag}, batch {job.batch_size})"
    ]
    stages = list(summary["ranks"][0]["stages_s"]) if summary["ranks"] else []
    lines.append("rank  " + " ".join(f"{s:>11}" for s in stages) + "   (seconds per stage)")
    for s in summary["ranks"]:
        lines.append(f"{s['rank']:>4}  " + " ".join(f"{s['stages_s'][k]:11.3f}" for k in stages))
    return "\n".join(lines)
