"""The output of `cleave score` and its progress record.

While a job runs, each rank writes what it scored into chunk files (one per `chunk`
iterations, each written to a temporary name and renamed) in `OUTPUT.progress/`, beside the
output, with `job.json`: what the job is (bundle, input files, batch size, ranks). The output
file appears only when every batch is scored: the chunks are merged in batch order into a
temporary file, renamed to OUTPUT, and the progress record is removed. A rerun of the same
job finds the record and resumes from the first chunk some rank is missing: that is the last
batch every rank completed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cleave.errors import UsageError

__all__ = ["Job", "chunk_path", "merge", "resume_iteration", "write_atomically"]

MERGED_ROWS = 65536  # rows per row group of the output file


@dataclass
class Job:
    """Everything a rank needs to know, written to `job.json` in the progress record."""

    bundle: str
    input: str
    output: str
    ranks: int
    batch_size: int
    rows: int
    key: str | None = None
    lag: int = 0
    table_layout: str = "tables"  # the planner's: whole tables per rank, or row ranges
    chunk: int = 16  # iterations per chunk file
    threads: int = 1
    timeout_s: float = 30.0
    block: int = 1  # consecutive batches a rank scores in a row (about a row group's)
    start: int = 0  # the iteration every rank starts from (a resumed job's)
    inject: dict = field(default_factory=dict)  # cleave bench score's delays
    fingerprint: str = ""

    @property
    def batches(self) -> int:
        return -(-self.rows // self.batch_size)

    @property
    def iterations(self) -> int:
        """Per rank: whole blocks, the last ones possibly past the end (empty batches)."""
        blocks = -(-self.batches // self.block)
        return -(-blocks // self.ranks) * self.block

    def batch(self, rank: int, iteration: int) -> int:
        """The global batch a rank scores in an iteration: blocks of `block` batches go
        round-robin over the ranks, so a rank decodes the row groups it scores, not every
        one (which rank scores a batch changes no score)."""
        blocks, within = divmod(iteration, self.block)
        return (blocks * self.ranks + rank) * self.block + within

    def scorer(self, batch: int) -> tuple[int, int]:
        """The (rank, iteration) that scores a global batch: `batch`'s inverse."""
        block, within = divmod(batch, self.block)
        return block % self.ranks, (block // self.ranks) * self.block + within

    @property
    def chunks(self) -> int:
        return -(-self.iterations // self.chunk)

    @property
    def work(self) -> Path:
        return progress_dir(Path(self.output))

    def save(self) -> Path:
        path = self.work / "job.json"
        write_atomically(path, json.dumps(asdict(self), indent=1).encode())
        return path

    @classmethod
    def load(cls, path: Path) -> Job:
        return cls(**json.loads(Path(path).read_text()))

    def what(self) -> str:
        """What makes two runs the same job: the bundle's manifest, the input files (name,
        size, time), batch size, ranks, key and table layout (a cut table's partial pools add
        in another order). Not the lag: every lag scores the same."""
        from cleave.bundle import manifest as manifest_io

        h = hashlib.sha256()
        h.update(
            json.dumps(manifest_io.read(Path(self.bundle), whole=False), sort_keys=True).encode()
        )
        inputs = Path(self.input)
        for f in sorted(inputs.iterdir()) if inputs.is_dir() else [inputs]:
            st = f.stat()
            h.update(f"{f.name} {st.st_size} {st.st_mtime_ns}\n".encode())
        shape = (self.batch_size, self.ranks, self.key, self.chunk, self.rows, self.block)
        shape += (self.table_layout,)
        h.update(repr(shape).encode())
        return h.hexdigest()


def progress_dir(output: Path) -> Path:
    return output.with_name(output.name + ".progress")


def chunk_path(job: Job, rank: int, chunk: int) -> Path:
    return job.work / f"rank{rank}-chunk{chunk:06d}.parquet"


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_chunk(job: Job, rank: int, chunk: int, batches: list[pa.Table]) -> None:
    """One chunk of a rank's batches, one row group per batch, written whole or not at all."""
    path = chunk_path(job, rank, chunk)
    tmp = path.with_name(f".{path.name}.tmp")
    schema = batches[0].schema
    with pq.ParquetWriter(tmp, schema) as writer:
        for table in batches:
            writer.write_table(table, row_group_size=max(1, table.num_rows))
    os.replace(tmp, path)


def check_output(output: Path) -> None:
    """The output's directory exists and takes new files: UsageError naming it otherwise."""
    parent = output.parent
    if output.is_dir():
        raise UsageError(f"{output}: is a directory; --output names the Parquet file to write")
    if not parent.is_dir():
        raise UsageError(f"{output}: cannot be written: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{output}: cannot be written: directory {parent} is not writable")


def resume_iteration(job: Job) -> tuple[int, str]:
    """The iteration a job starts from, and what was found: a progress record of the same job
    resumes after its last chunk that every rank wrote; a record of another job is removed."""
    work = job.work
    old = work / "job.json"
    if old.exists():
        try:
            previous = Job.load(old)
        except (OSError, ValueError, TypeError):
            previous = None
        if previous is not None and previous.fingerprint == job.fingerprint:
            done = min(_chunks_done(job, r) for r in range(job.ranks))
            start = done * job.chunk
            if start:
                return start, (
                    f"resuming from iteration {start} of {job.iterations}, every rank's "
                    f"batches before it scored (progress in {work})"
                )
            return 0, ""
        shutil.rmtree(work)
        work.mkdir()
        return 0, f"removed the progress record of a different job in {work}"
    work.mkdir(exist_ok=True)
    return 0, ""


def _chunks_done(job: Job, rank: int) -> int:
    done = 0
    while done < job.chunks and chunk_path(job, rank, done).exists():
        done += 1
    return done


def merge(job: Job) -> Path:
    """The chunks in batch order into OUTPUT (a temporary file renamed), then the progress
    record removed."""
    output = Path(job.output)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    readers: dict[int, tuple[int, pq.ParquetFile]] = {}  # rank -> its chunk being read
    pending: list[pa.Table] = []
    writer = None
    try:
        for batch in range(job.batches):
            rank, iteration = job.scorer(batch)
            chunk = iteration // job.chunk
            if readers.get(rank, (None,))[0] != chunk:
                readers[rank] = chunk, pq.ParquetFile(chunk_path(job, rank, chunk))
            pending.append(readers[rank][1].read_row_group(iteration % job.chunk))
            if sum(t.num_rows for t in pending) >= MERGED_ROWS or batch == job.batches - 1:
                table = pa.concat_tables(pending)
                writer = writer or pq.ParquetWriter(tmp, table.schema)
                writer.write_table(table, row_group_size=MERGED_ROWS)
                pending = []
        writer.close()
        os.replace(tmp, output)
    except BaseException:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)
        raise
    shutil.rmtree(job.work)
    return output
