"""A `cleave score` job from start to end: the checks before any rank starts, the progress
record (a resumed job starts where every rank had got to), the ranks (in this process, or
`ranks` processes), the merge into the output, and a summary."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cleave.bundle import manifest as manifest_io
from cleave.errors import CleaveError, UsageError
from cleave.score.input import InputFiles, Schema, check_input
from cleave.score.output import Job, check_output, merge, resume_iteration
from cleave.score.ranks import RankGroup
from cleave.settings.choices import TABLE_LAYOUTS

__all__ = ["prepare", "run", "run_torchrun", "under_torchrun"]


def prepare(
    bundle: str | Path,
    input: str | Path,
    output: str | Path,
    *,
    ranks: int = 1,
    lag: int = 0,
    batch_size: int = 1024,
    table_layout: str = "tables",
    key: str | None = None,
    threads: int | None = None,
    timeout_s: float = 30.0,
    chunk: int = 16,
    inject: dict | None = None,
) -> tuple[Job, str]:
    """The job, checked (model, input, output) and placed against its progress record, and
    a note (resumed, or an old record removed). UsageError before any rank starts."""
    if table_layout not in TABLE_LAYOUTS:
        raise UsageError(
            f"--table-layout must be one of {', '.join(TABLE_LAYOUTS)}, got {table_layout!r}"
        )
    if ranks < 1 or lag < 0 or batch_size < 1 or chunk < 1:
        raise UsageError(
            f"--ranks ({ranks}) and --batch-size ({batch_size}) must be at least 1, --lag "
            f"({lag}) at least 0"
        )
    manifest = manifest_io.read(Path(bundle))
    schema = Schema(manifest)
    output = Path(output).absolute()
    check_output(output)
    reserved = [name for name, _ in schema.outputs]
    if (key or "row") in reserved:
        raise UsageError(f"the key column {key or 'row'!r} has the name of a model output")
    files = InputFiles(input)
    check_input(schema, files, key)
    batches = -(-files.rows // batch_size)
    group_rows = max(files.parquet[i].metadata.row_group(g).num_rows for _, i, g in files.groups)
    job = Job(
        block=max(1, min(group_rows // batch_size, -(-batches // ranks))),
        bundle=str(Path(bundle).absolute()),
        input=str(Path(input).absolute()),
        output=str(output),
        ranks=ranks,
        batch_size=batch_size,
        rows=files.rows,
        key=key,
        lag=lag,
        table_layout=table_layout,
        chunk=chunk,
        threads=threads or max(1, _cores() // ranks),
        timeout_s=timeout_s,
        inject=inject or {},
    )
    job.fingerprint = job.what()
    job.start, note = resume_iteration(job)
    job.save()
    return job, note


def run(
    job: Job, processes: bool, on_event: Callable[[int, dict], None] = lambda r, e: None
) -> dict:
    """Scores the job (in this process when `processes` is False and it has one rank, else
    in rank processes), merges the output, and returns the summary: rows, seconds, rows/s,
    each rank's statistics."""
    began = time.perf_counter()
    if processes:
        store = job.work / f"store-{os.getpid()}-{time.time_ns()}"
        group = RankGroup(job, store)
        stopped = _on_sigterm()
        try:
            group.watch(on_event, grace_s=job.timeout_s + 5)
        finally:
            group.stop()  # a launcher stopped (SIGTERM, ^C) stops its ranks
            store.unlink(missing_ok=True)
            stopped()
        stats = [s.stats for s in group.states]
    else:
        import torch

        from cleave.score.pipeline import RankScorer

        torch.set_num_threads(job.threads)
        scorer = RankScorer(
            job, 0, 1, on_report=lambda kind, **e: on_event(0, {"event": kind, **e})
        )
        scorer.warm()
        stats = [scorer.run()]
    merge(job)
    return _summary(stats, began)


def _on_sigterm() -> Callable[[], None]:
    """SIGTERM raises KeyboardInterrupt in the main thread until the returned undo is called."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, previous)


def under_torchrun() -> bool:
    """Started by torchrun (or another launcher with its environment): every process is a
    rank, the rendezvous is env://."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_torchrun(options: dict, on_event: Callable[[int, dict], None]) -> tuple[Job, dict] | None:
    """This process as one rank of a torchrun job over `options` (prepare's arguments; the
    output on a file system every rank sees): rank 0 checks the input and writes the progress
    record while the others wait, every rank scores, rank 0 merges. The job and its summary
    on rank 0, None on the others."""
    import torch
    import torch.distributed as dist

    from cleave.score.pipeline import RankScorer
    from cleave.score.ranks import init_group, leave_group

    began = time.perf_counter()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Rank 0's checks read the whole input: the others wait for them up to an hour.
    init_group(rank, world, None, startup_s=3600)
    message: list = [None]
    if rank == 0:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # ranks on this machine
        options = {**options, "threads": options.get("threads") or max(1, _cores() // local)}
        try:
            job, note = prepare(**options, ranks=world)
            message = [job]
            if note:
                print(note, file=sys.stderr, flush=True)
        except CleaveError as err:
            message = [str(err)]
    dist.broadcast_object_list(message, src=0)
    if isinstance(message[0], str):
        raise UsageError(message[0] if rank == 0 else f"rank 0 refused the job: {message[0]}")
    job = message[0]
    torch.set_num_threads(job.threads)
    scorer = RankScorer(
        job, rank, world, on_report=lambda kind, **e: on_event(rank, {"event": kind, **e})
    )
    scorer.warm()
    dist.barrier()
    stats = scorer.run()
    gathered = [None] * world
    dist.gather_object(stats, gathered if rank == 0 else None, dst=0)
    leave_group()
    if rank != 0:
        return None
    merge(job)
    return job, _summary(gathered, began)


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _summary(stats: list[dict], began: float) -> dict:
    rows = sum(s["rows"] for s in stats)
    scoring = max((s["seconds"] for s in stats), default=0.0)  # from ranks up to last batch
    return {
        "rows": rows,
        "seconds": time.perf_counter() - began,  # with start-up (loading the bundle) and merge
        "scoring_s": scoring,
        "rows_per_s": rows / scoring if scoring else 0.0,
        "ranks": stats,
    }
