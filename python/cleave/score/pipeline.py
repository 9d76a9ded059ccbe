"""One rank of a `cleave score` job (docs/score.md, "Ranks").

Rank r scores one global batch per iteration (batch b is input rows [b*B, (b+1)*B)): blocks of
about a row group's batches go round-robin over the ranks (`Job.batch`). It holds the rows the
planner's `table_layout` gives it (`plan.planner.table_ranges`, as it gives shards): whole
tables ("tables", the default here), or a row range of every table ("rows"). Iteration i,
with lag K:

1. read batch i, send each owner its bags' ids — a table cut into row ranges gets each bag cut
   along them (the ids collective, iteration i);
2. as an owner: receive every rank's ids of iteration i - K, pool them with Cleave's engine
   (`cleave._native.TableSet`), send the pooled rows back (the pooled collective, i - K); a
   cut bag pools partially (a mean as a sum);
3. receive the pooled rows of iteration i - 2K, merge the partial pools in owner order (sums
   added, maxima of the owners that had ids, means divided by the bag's length, gathered rows
   put back in place), run the dense program (once per request for a model with per-request
   inputs: `Schema.requests`), keep the scores.

Every wait is on an iteration K behind the one started, so a rank blocks only when a peer is
more than K iterations behind it (BLS Listing 2, for two collectives in a row). K = 0 is two
synchronous alltoallvs per batch. Which rank computes what does not depend on K, so every K
gives the same bits.

Run as `python -m cleave.score.pipeline JOB --rank R --world N [--store FILE]` by
`cleave score --ranks N`, or under torchrun without --store (its env:// rendezvous).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from cleave.errors import CleaveError
from cleave.plan.planner import table_ranges
from cleave.score.collective import BoundedLagAlltoallv
from cleave.score.input import InputFiles, Schema, apply_transform, flat_values
from cleave.score.output import Job, write_chunk
from cleave.score.ranks import init_group, report

__all__ = ["RankScorer", "main"]

STAGES = ("delay", "read", "wait_ids", "pool", "wait_pooled", "dense", "write")


class RankScorer:
    """What one rank holds: its tables, the dense program, its reader and the collectives."""

    def __init__(self, job: Job, rank: int, world: int, on_report=report):
        from cleave import _native
        from cleave.bundle import load_bundle

        self.job, self.rank, self.world = job, rank, world
        # Each rank is a process of its own: its dense module from the bundle's stored graph.
        self.bundle = load_bundle(job.bundle, stored_graphs=True)
        self.schema = Schema(self.bundle.manifest)
        tables = {t["name"]: t for t in self.bundle.manifest["tables"]}
        held = table_ranges(self.bundle.manifest, world, job.table_layout)
        # Per table, its owners in rank order and where each owner's rows start.
        self.owners = {t: [r for r in range(world) if t in held[r]] for t in tables}
        self.cuts = {t: np.array([held[r][t][0] for r in o[1:]]) for t, o in self.owners.items()}
        whole = [t for t, (a, b) in held[rank].items() if (a, b) == (0, tables[t]["rows"])]
        self.lookups = {}  # table -> the TableSet holding this rank's rows of it
        if whole:
            opened = _native.TableSet.open(job.bundle, tables=whole, threads=job.threads)
            self.lookups = dict.fromkeys(whole, opened)
        for t, rows in held[rank].items():
            if t not in self.lookups:
                self.lookups[t] = _native.TableSet.open(
                    job.bundle, tables=[t], rows=rows, threads=job.threads
                )
        dims = {name: t["dim"] for name, t in tables.items()}
        self.by_owner = [
            [f for f in self.schema.features if r in self.owners[f.table]] for r in range(world)
        ]
        self.dims = {f.name: dims[f.table] for f in self.schema.features}
        self.dense = self.bundle.dense_module()
        self.files = InputFiles(job.input)
        self.columns = list(self.schema.columns) + ([job.key] if job.key else [])
        self.report = on_report
        self.times = dict.fromkeys(STAGES, 0.0)
        self.steps: list[float] = []
        self._rng_seed = int(job.inject.get("seed", 0))

    def warm(self) -> None:
        """Runs the dense program once on two rows (pooled rows zero) and reads the first row
        group, so the first batch does not pay for PyTorch's and the reader's first calls."""
        rows = min(2, self.job.rows)
        table = self.files.read(0, rows, self.columns)
        starts = self.schema.requests(table, rows)
        firsts = _firsts(table, starts)
        lengths = {name: bag[1] for name, bag in self._bags(table, rows, firsts).items()}
        zeros = {
            f.name: torch.zeros(
                int(lengths[f.name].sum()) if f.pooling == "none" else len(lengths[f.name]),
                self.dims[f.name],
            )
            for f in self.schema.features
        }
        with torch.inference_mode():
            for values in self._dense_calls(table, rows, starts, firsts, zeros, lengths):
                self.bundle.run_dense(values, self.dense)

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> dict:
        """Scores this rank's batches (after the process group is up) and returns its
        statistics; each finished batch is reported."""
        job, K = self.job, self.job.lag
        self.ids = BoundedLagAlltoallv(K, torch.uint8, tag=0, timeout_s=job.timeout_s)
        self.pooled = BoundedLagAlltoallv(K, torch.float32, tag=1, timeout_s=job.timeout_s)
        first, last = job.start, job.iterations  # this run's iterations [first, last)
        batches: dict[int, tuple] = {}  # iteration -> (rows table, (rows, its bags cut))
        chunk: list[pa.Table] = []
        rows_done, began, cpu = 0, time.perf_counter(), time.process_time()
        for step in range(first, last + 2 * K):
            t0 = time.perf_counter()
            if step < last:
                self._delay(step)
                batches[step] = self._send_ids(step - first, step)
            j = step - K
            if first <= j < last:
                self._pool(j - first)
            m = step - 2 * K
            if first <= m < last:
                table, counts = batches.pop(m)
                scores = self._finish(m - first, table, counts, m)
                if scores is not None:
                    chunk.append(scores)
                    rows_done += scores.num_rows
                if (m + 1) % job.chunk == 0 or m == last - 1:
                    t = time.perf_counter()
                    if chunk:
                        write_chunk(job, self.rank, m // job.chunk, chunk)
                    self.times["write"] += time.perf_counter() - t
                    chunk = []
                self.report(
                    "batch",
                    total=job.rows,
                    ranks=self.world,
                    rows=rows_done,
                    next=self._batch(m + 1),
                )
            self.steps.append(time.perf_counter() - t0)
        self.ids.close()
        self.pooled.close()
        elapsed = time.perf_counter() - began
        return {
            "cpu_s": time.process_time() - cpu,  # every thread's: gloo's I/O too
            "rank": self.rank,
            "rows": rows_done,
            "iterations": last - first,
            "seconds": elapsed,
            "stages_s": self.times,
            "steps_s": self.steps,
        }

    def _batch(self, iteration: int) -> int:
        return self.job.batch(self.rank, iteration)

    def _delay(self, iteration: int) -> None:
        """cleave bench score's injected imbalance: a sleep before the iteration's work."""
        inject = self.job.inject
        if not inject:
            return
        d = float(inject["delay_s"])
        if inject["kind"] == "random_delay":  # uniform on [0, 2d], per rank and iteration
            d = np.random.default_rng([self._rng_seed, self.rank, iteration]).uniform(0, 2 * d)
        elif inject["kind"] == "straggler":  # one rank always slow, the others never
            d = d if self.rank == self.world - 1 else 0.0
        else:
            return
        t = time.perf_counter()
        time.sleep(d)
        self.times["delay"] += time.perf_counter() - t

    def _send_ids(self, it: int, iteration: int) -> tuple:
        t = time.perf_counter()
        b = self._batch(iteration)
        start = min(b * self.job.batch_size, self.job.rows)
        stop = min(start + self.job.batch_size, self.job.rows)
        table = self.files.read(start, stop, self.columns) if stop > start else None
        rows = stop - start
        starts = self.schema.requests(table, rows) if rows else None
        firsts = _firsts(table, starts)
        requests = rows if starts is None else len(starts) - 1
        cut: dict[str, _Cut] = {}  # feature -> how its bags went to its owners
        parts: list[list[np.ndarray]] = [
            [np.array([rows, requests], dtype=np.int64)] for _ in range(self.world)
        ]
        for f, (ids, lengths, w) in zip(
            self.schema.features, self._bags(table, rows, firsts).values(), strict=True
        ):
            owners = self.owners[f.table]
            c = cut[f.name] = _Cut(lengths, owners, ids, self.cuts[f.table])
            for k, owner in enumerate(owners):
                mine = c.which == k if c.which is not None else slice(None)
                parts[owner] += [c.lengths[k], ids[mine]]
                if f.weights:
                    parts[owner].append(np.asarray(w, dtype=np.float32)[mine])
        sends = [torch.from_numpy(np.concatenate([p.view(np.uint8) for p in ps])) for ps in parts]
        self.ids.start(it, sends)
        self.times["read"] += time.perf_counter() - t
        return table, (rows, starts, firsts, cut)

    def _bags(self, table, rows: int, firsts) -> dict[str, tuple]:
        """Per feature, its bags in a batch: (ids after the transform, each bag's length,
        weights or None); a bag per row, or per request for a per-request feature (from the
        request's first row: `firsts`)."""
        bags = {}
        for f in self.schema.features:
            source = firsts if f.request_shape is not None else table
            if not rows:
                bags[f.name] = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
                continue
            values, lengths = flat_values(source.column(f.column).combine_chunks())
            lengths = np.ones(source.num_rows, np.int64) if lengths is None else lengths
            ids = apply_transform(values, f.transform).astype(np.int64, copy=False)
            w = flat_values(source.column(f.weights).combine_chunks())[0] if f.weights else None
            bags[f.name] = (ids, lengths.astype(np.int64, copy=False), w)
        return bags

    def _pool(self, it: int) -> None:
        """As an owner: every rank's bags of this iteration, pooled, sent back."""
        t = time.perf_counter()
        got = self.ids.wait(it)
        self.times["wait_ids"] += time.perf_counter() - t
        t = time.perf_counter()
        mine = self.by_owner[self.rank]
        per_sender = [_parse(msg.numpy(), mine) for msg in got]
        replies: list[list[np.ndarray]] = [[] for _ in range(self.world)]
        for k, f in enumerate(mine):
            lengths = np.concatenate([s[k][0] for s in per_sender])
            ids = np.concatenate([s[k][1] for s in per_sender])
            lookups = self.lookups[f.table]
            if f.pooling == "none":
                out = lookups.gather(f.table, ids)
                sizes = [len(s[k][1]) for s in per_sender]
            else:
                weights = np.concatenate([s[k][2] for s in per_sender]) if f.weights else None
                offsets = np.zeros(len(lengths) + 1, np.int64)
                np.cumsum(lengths, out=offsets[1:])
                # a bag cut along row ranges: a mean is merged as a sum, divided at the end
                cut = len(self.owners[f.table]) > 1 and f.pooling == "mean"
                out, _ = lookups.pool(f.table, ids, offsets, weights, "sum" if cut else f.pooling)
                sizes = [len(s[k][0]) for s in per_sender]
            for sender, part in enumerate(np.split(out, np.cumsum(sizes)[:-1])):
                replies[sender].append(part.reshape(-1))
        sends = [torch.from_numpy(np.concatenate(r)) if r else torch.zeros(0) for r in replies]
        self.pooled.start(it, sends)
        self.times["pool"] += time.perf_counter() - t

    def _finish(self, it: int, table, sent: tuple, iteration: int) -> pa.Table | None:
        rows, starts, firsts, cut = sent
        requests = rows if starts is None else len(starts) - 1

        def size(f, owner: int) -> int:  # floats of f's rows from an owner: per bag, or per id
            if f.pooling == "none":
                return self.dims[f.name] * int(cut[f.name].of(owner).sum())
            return self.dims[f.name] * (requests if f.request_shape is not None else rows)

        expect = [sum(size(f, r) for f in features) for r, features in enumerate(self.by_owner)]
        t = time.perf_counter()
        got = self.pooled.wait(it, expect)
        self.times["wait_pooled"] += time.perf_counter() - t
        if not rows:
            return None
        t = time.perf_counter()
        blocks: dict[str, list[torch.Tensor]] = {f.name: [] for f in self.schema.features}
        for owner, features in enumerate(self.by_owner):
            at = 0
            for f in features:
                blocks[f.name].append(got[owner][at : at + size(f, owner)])
                at += size(f, owner)
        merged = {
            f.name: cut[f.name].merge(blocks[f.name], f.pooling, self.dims[f.name])
            for f in self.schema.features
        }
        lengths = {f.name: cut[f.name].total for f in self.schema.features}
        parts = []
        with torch.inference_mode():
            for values in self._dense_calls(table, rows, starts, firsts, merged, lengths):
                parts.append(self.bundle.run_dense(values, self.dense))
        outputs = [torch.cat(o) for o in zip(*parts, strict=True)] if len(parts) > 1 else parts[0]
        columns = {}
        if self.job.key:
            columns[self.job.key] = table.column(self.job.key)
        else:
            start = self._batch(iteration) * self.job.batch_size
            columns["row"] = pa.array(np.arange(start, start + rows, dtype=np.int64))
        for (name, width), out in zip(self.schema.outputs, outputs, strict=True):
            flat = out.detach().float().reshape(rows, -1).numpy()
            columns[name] = (
                pa.array(flat[:, 0])
                if width == 1
                else pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])
            )
        self.times["dense"] += time.perf_counter() - t
        return pa.table(columns)

    def _dense_calls(
        self, table, rows: int, starts, firsts, merged: dict, lengths: dict
    ) -> list[dict]:
        """The dense program's inputs for a batch: one call, or one per request for a model
        with per-request inputs (a request's user is never joined with another's, as online).
        `merged`: each feature's rows from the owners; `lengths`: its bags' lengths."""
        per_row: dict[str, torch.Tensor] = {}
        per_id: dict[str, tuple[torch.Tensor, np.ndarray]] = {}  # rows [ids in batch, dim]
        per_request: dict[str, list[torch.Tensor]] = {}
        for f in self.schema.features:
            rows_of, dim = merged[f.name], self.dims[f.name]
            if f.request_shape is not None:
                sizes = lengths[f.name] if f.pooling == "none" else np.ones(len(starts) - 1, int)
                per_request[f.output] = [
                    part.reshape(*f.request_shape, dim)
                    for part in torch.split(rows_of.reshape(-1, dim), sizes.tolist())
                ]
            elif f.shape is None:
                per_id[f.output] = (rows_of.reshape(-1, dim), lengths[f.name])
            else:
                per_row[f.output] = rows_of.reshape(rows, *f.shape, dim)
        per_row.update(self._dense_inputs(table, rows))
        if starts is None:
            return [per_row | {name: t for name, (t, _) in per_id.items()}]
        for name in self.schema.request_columns:
            if name in self.schema.dense_shapes:
                per_request[name] = self._request_inputs(firsts, name)
        id_at = {name: np.concatenate([[0], np.cumsum(n)]) for name, (_, n) in per_id.items()}
        calls = []
        for g, (s, e) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
            values = {name: t[s:e] for name, t in per_row.items()}
            values |= {name: t[id_at[name][s] : id_at[name][e]] for name, (t, _) in per_id.items()}
            values |= {name: parts[g] for name, parts in per_request.items()}
            calls.append(values)
        return calls

    def _dense_inputs(self, table, rows: int) -> dict[str, torch.Tensor]:
        """The dense program's per-sample inputs of a batch (not its per-request ones)."""
        values = {}
        for name in self.schema.dense_inputs:
            if name in self.schema.request_columns:
                continue
            col = self.schema.columns[name]
            flat, _ = flat_values(table.column(name).combine_chunks())
            dtype = getattr(torch, col.dtype)
            shape = [rows, *self.schema.dense_shapes[name]]
            values[name] = torch.from_numpy(np.ascontiguousarray(flat)).to(dtype).reshape(shape)
        for name, column in self.schema.key_lengths.items():  # a KJT's lengths, per key
            lengths = flat_values(table.column(column).combine_chunks())[1]
            values[name] = torch.from_numpy(lengths.astype(np.int64))
        return values

    def _request_inputs(self, firsts: pa.Table, name: str) -> list[torch.Tensor]:
        """A per-request dense input, each request's from its first row, in its own shape."""
        flat, lengths = flat_values(firsts.column(name).combine_chunks())
        dtype = getattr(torch, self.schema.columns[name].dtype)
        at = np.concatenate([[0], np.cumsum(lengths if lengths is not None else [1] * len(flat))])
        whole = torch.from_numpy(np.ascontiguousarray(flat)).to(dtype)
        shape = self.schema.dense_shapes[name]
        return [whole[a:b].reshape(shape) for a, b in zip(at[:-1], at[1:], strict=True)]


def _firsts(table, starts) -> pa.Table | None:
    """Each request's first row of a batch (None: a model without per-request inputs)."""
    return table.take(starts[:-1]) if starts is not None else None


class _Cut:
    """One feature's bags in a batch, cut along its table's owners' row ranges (`cuts`: where
    each owner after the first starts): per owner, the bag lengths it was sent; `which`, the
    owner of each id (None when the table has one owner). `merge` puts the owners' replies
    back together, in owner order, so that every lag gives the same bits."""

    def __init__(self, lengths: np.ndarray, owners: list[int], ids: np.ndarray, cuts):
        self.total = lengths
        self.owners = owners
        if len(owners) == 1:
            self.which, self.lengths = None, [lengths]
            return
        self.which = np.searchsorted(cuts, ids, side="right")
        bag = np.repeat(np.arange(len(lengths)), lengths)
        self.lengths = [
            np.bincount(bag[self.which == k], minlength=len(lengths)) for k in range(len(owners))
        ]

    def of(self, owner: int) -> np.ndarray:
        return self.lengths[self.owners.index(owner)]

    def merge(self, blocks: list[torch.Tensor], pooling: str, dim: int) -> torch.Tensor:
        if self.which is None:
            return blocks[0]
        if pooling == "none":  # gathered rows: each owner's to its ids' places
            out = torch.empty(len(self.which), dim)
            for k, block in enumerate(blocks):
                out[torch.from_numpy(self.which == k)] = block.reshape(-1, dim)
            return out
        parts = [b.reshape(-1, dim) for b in blocks]
        if pooling == "max":  # only owners that had ids of a bag take part in its max
            out, seen = parts[0].clone(), torch.from_numpy(self.lengths[0] > 0)
            for part, lengths in zip(parts[1:], self.lengths[1:], strict=True):
                has = torch.from_numpy(lengths > 0)
                out[has & seen] = torch.maximum(out[has & seen], part[has & seen])
                out[has & ~seen] = part[has & ~seen]
                seen |= has
            return out
        out = parts[0].clone()
        for part in parts[1:]:
            out += part
        if pooling == "mean":  # the engine's mean: the sum over the bag's length, when > 1
            n = torch.from_numpy(self.total).to(torch.float32).unsqueeze(1)
            out = torch.where(n > 1, out / n, out)
        return out


def _parse(msg: np.ndarray, features) -> list[tuple]:
    """A rank's ids message for this owner: [rows, requests], then (lengths, ids, weights)
    per feature, in order."""
    rows, requests = (int(n) for n in msg[:16].view(np.int64))
    at, out = 16, []
    for f in features:
        bags = requests if f.request_shape is not None else rows
        lengths = msg[at : at + 8 * bags].view(np.int64)
        at += 8 * bags
        n = int(lengths.sum())
        ids = msg[at : at + 8 * n].view(np.int64)
        at += 8 * n
        weights = None
        if f.weights:
            weights = msg[at : at + 4 * n].view(np.float32)
            at += 4 * n
        out.append((lengths, ids, weights))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cleave.score.pipeline")
    parser.add_argument("job", type=Path)
    parser.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
    parser.add_argument("--world", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    parser.add_argument("--store", type=Path, default=None)
    args = parser.parse_args(argv)
    job = Job.load(args.job)
    try:
        torch.set_num_threads(job.threads)
        scorer = RankScorer(job, args.rank, args.world)
        scorer.warm()
        init_group(args.rank, args.world, args.store, startup_s=max(job.timeout_s, 60.0))
        if args.world > 1:
            torch.distributed.barrier()  # every rank loaded and warm: the clocks start together
        report("ready")
        stats = scorer.run()
        report("done", stats=stats)
    except CleaveError as err:
        report("error", message=str(err))
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
