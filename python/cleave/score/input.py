"""The input of `cleave score`: which Parquet column feeds which model input, reading by row
group, and the checks made before any rank starts (docs/score.md, "Input").

One row is one sample. A model input whose leading size is the batch is a column named after
it (a scalar column when a sample's slice has one element, else a list column); a bag
feature's ids (and weights) given as flat ids with offsets are a list column named after the
ids (weights) input, the offsets input has none; fixed-size bags and per-position gathers
are list columns of the sample's ids; a KJT input `p` is a list column `p.KEY` per key (and
`p.KEY.weights`). An input looked up or read once per request (its leading size is not the
batch: `din`'s user history) is a column holding the request's value in each of its rows;
consecutive rows with equal such values are one request (`Schema.requests`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cleave.bundle.manifest import reads_rows
from cleave.errors import UsageError

__all__ = ["Column", "InputFiles", "Schema", "SparseFeature", "apply_transform", "flat_values"]


@dataclass
class Column:
    """One input column: `name` in the file, what a row holds and what it feeds."""

    name: str
    kind: str  # "int" or "float": the element type
    width: int | None  # elements per row: 1 a scalar column, None a list of any length
    symbolic: bool = False  # a list whose length is a model symbol: equal in every row
    feeds: list[str] = field(default_factory=list)  # model inputs / features it feeds
    dtype: str = "int64"  # the model input's dtype
    id_ranges: list[tuple[str, str, list, int]] = field(default_factory=list)
    # (feature, table, transform, rows): ids after `transform` must lie in [0, rows)

    @property
    def arrow_type(self) -> str:
        element = "int64" if self.kind == "int" else "float"
        if self.width == 1:
            return element
        return f"list<{element}>" + (f"[{self.width}]" if self.width else "")


@dataclass
class SparseFeature:
    """A lookup: per sample, a bag of ids from `column` (weights from `weights`); pooled
    into [rows, dim], or gathered into [rows, *shape, dim] when `pooling` is "none" (a KJT key
    read row by row, an EmbeddingCollection's: [every id of the batch, dim], shape None)."""

    name: str
    table: str
    column: str
    weights: str | None
    pooling: str
    transform: list
    output: str  # the boundary tensor
    shape: tuple[int, ...] | None = ()  # a gather's ids per sample; None: [ids in batch, dim]
    # Looked up once per request (None: per sample): a request's lookup output shape without
    # dim, (1,) for its one bag, a gather's input shape (its ids' rows) for a gather.
    request_shape: tuple[int, ...] | None = None


class Schema:
    """A bundle's input columns, lookups, dense inputs and output columns."""

    def __init__(self, manifest: dict):
        self.manifest = manifest
        inputs = {i["name"]: i for i in manifest["inputs"]}
        tables = {t["name"]: t for t in manifest["tables"]}
        self.columns: dict[str, Column] = {}
        self.features: list[SparseFeature] = []
        self.request_columns: list[str] = []  # a request's value in each of its rows
        per_request = set(manifest.get("shared_inputs", []))
        refused = []

        def column(name, spec_dtype, width, symbolic=False) -> Column:
            kind = "float" if spec_dtype.startswith(("float", "bfloat")) else "int"
            col = self.columns.setdefault(name, Column(name, kind, width, symbolic, [], spec_dtype))
            return col

        kjts = {k["name"]: k for k in manifest.get("kjts", [])}
        # A KJT whose lengths the dense program reads gets them per key, a row's list length.
        self.key_lengths = {
            name: f"{k['name']}.{key}"
            for k in kjts.values()
            for name, key in zip(k.get("lengths_by_key") or [], k["keys"], strict=False)
        }
        for name, ids in self.key_lengths.items():
            kjt = kjts[ids.rsplit(".", 1)[0]]
            column(ids, inputs[kjt["values"]]["dtype"], None).feeds.append(f"{name} (lengths)")
        for f in manifest["features"]:
            table = tables[f["table"]]
            request_shape = None
            if f["layout"] == "kjt":
                ids = f"{f['kjt']}.{f['key']}"
                weights = f"{ids}.weights" if kjts[f["kjt"]].get("weights") else None
                col = column(ids, inputs[f["ids"]]["dtype"], None)
                shape: tuple[int, ...] | None = None if reads_rows(f) else ()
            elif f["ids"] in per_request:
                spec, weights = inputs[f["ids"]], f.get("weights")
                if f["pooling"] != "none" and not _one_bag(f, inputs):
                    refused.append(f"{f['ids']} {spec['shape']} (more than one bag a request)")
                    continue
                whole = _width(spec["shape"])[0] if f["pooling"] == "none" else None
                col = column(f["ids"], spec["dtype"], whole)
                self.request_columns += [n for n in (f["ids"], weights) if n]
                shape = ()
                request_shape = (1,)  # one bag
                if f["pooling"] == "none":
                    request_shape = tuple(d if isinstance(d, int) else -1 for d in spec["shape"])
            else:
                spec = inputs[f["ids"]]
                weights = f.get("weights")
                if f["layout"] == "offsets":
                    col = column(f["ids"], spec["dtype"], None)
                    shape = ()
                elif spec["shape"][:1] != ["B"]:
                    refused.append(f"{f['ids']} {spec['shape']}")
                    continue
                else:
                    rest = spec["shape"][1:]
                    width, symbolic = _width(rest)
                    col = column(f["ids"], spec["dtype"], width, symbolic)
                    shape = tuple(int(d) if isinstance(d, int) else -1 for d in rest)
                    if f["layout"] == "fixed":
                        shape = ()
            if weights:
                wspec = inputs.get(f.get("weights"), {"dtype": "float32"})
                column(weights, wspec["dtype"], None).feeds.append(f"{f['name']} weights")
            col.feeds.append(f"feature {f['name']}" + (" (per request)" if request_shape else ""))
            col.id_ranges.append((f["name"], f["table"], f["transform"], int(table["rows"])))
            self.features.append(
                SparseFeature(
                    f["name"],
                    f["table"],
                    col.name,
                    weights,
                    f["pooling"],
                    f["transform"],
                    f["output"],
                    shape,
                    request_shape,
                )
            )
        self.dense_inputs = [n for n in manifest["dense"]["inputs"] if n in inputs]
        self.dense_shapes = {}  # per row, or a request's whole input (a request column)
        for name in self.dense_inputs:
            spec = inputs[name]
            shape = [d if isinstance(d, int) else -1 for d in spec["shape"]]
            if spec["shape"][:1] == ["B"]:
                self.dense_shapes[name] = shape[1:]
                width, symbolic = _width(spec["shape"][1:])
                column(name, spec["dtype"], width, symbolic).feeds.append("dense program")
            else:  # a per-request input: any length, the request's rows equal
                self.dense_shapes[name] = shape
                whole = _width(spec["shape"])[0]
                column(name, spec["dtype"], whole).feeds.append("dense program (per request)")
                self.request_columns.append(name)
        if refused:
            raise UsageError(
                "cleave score reads one sample per row, and this model has inputs it cannot "
                f"lay out as rows ({', '.join(refused)}); score such a model through cleave serve"
            )
        self.outputs = [(o["name"], _width(o["shape"][1:])[0]) for o in manifest["outputs"]]

    def requests(self, table: pa.Table, rows: int) -> np.ndarray | None:
        """Where each request of a batch starts, and `rows` last: a request is a run of
        consecutive rows whose per-request columns are equal (None: a model without them,
        every row its own sample)."""
        if not self.request_columns:
            return None
        new = np.zeros(rows, bool)
        new[:1] = True
        for name in self.request_columns:
            values, lengths = flat_values(table.column(name).combine_chunks())
            if lengths is None:
                new[1:] |= values[1:] != values[:-1]
                continue
            new[1:] |= lengths[1:] != lengths[:-1]
            if len(lengths) and (lengths == lengths[0]).all():  # one length: compare at once
                if lengths[0]:
                    each = values.reshape(rows, -1)
                    new[1:] |= (each[1:] != each[:-1]).any(axis=1)
                continue
            at = np.concatenate([[0], np.cumsum(lengths)])
            for r in np.flatnonzero(~new[1:]) + 1:
                new[r] = not np.array_equal(values[at[r - 1] : at[r]], values[at[r] : at[r + 1]])
        return np.append(np.flatnonzero(new), rows)

    def describe(self, key: str | None = None) -> str:
        """The columns a file must have, and those the output gets: `--print-schema`."""
        first = key or "row"
        rows = [("column", "type", "feeds")]
        for c in self.columns.values():
            note = " (every row the same length)" if c.symbolic else ""
            rows.append((c.name, c.arrow_type, ", ".join(c.feeds) + note))
        rows += [("", "", ""), ("output column", "type", "")]
        rows.append(
            (
                first,
                "(as in input)" if key else "int64",
                "copied from the input" if key else "the input row's index",
            )
        )
        for name, width in self.outputs:
            rows.append((name, "float" if width == 1 else f"list<float>[{width}]", "model output"))
        w = max(len(r[0]) for r in rows) + 2
        text = "\n".join(f"{a:<{w}}{b:<22}{c}".rstrip() for a, b, c in rows)
        if self.request_columns:
            text += (
                "\n\nper request: a request's value in each of its rows; consecutive rows with "
                "equal per-request columns are one request"
            )
        return text


def _one_bag(feature: dict, inputs: dict) -> bool:
    """A per-request bag feature pools one bag a request: a row can hold one bag's ids."""
    if feature["layout"] != "offsets":
        return inputs[feature["ids"]]["shape"][:1] == [1]  # fixed bags [1, L]
    size = inputs[feature["offsets"]]["shape"]
    return size == [2 if feature.get("include_last_offset") else 1]


def _width(rest: list) -> tuple[int | None, bool]:
    """Elements per row of a slice shaped `rest`: a product of static sizes, or (None,
    symbolic) when a size is a symbol (a list of one length in every row)."""
    if all(isinstance(d, int) for d in rest):
        return math.prod(rest), False
    return None, True


class InputFiles:
    """A Parquet file or a directory of them (sorted by name), read as one sequence of rows
    by row group: memory holds one row group per column set at a time."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix == ".parquet")
            if not files:
                raise UsageError(f"{path}: a directory with no .parquet files")
        elif path.exists():
            files = [path]
        else:
            raise UsageError(f"{path}: no such file or directory")
        self.files: list[Path] = files
        self.parquet: list[pq.ParquetFile] = []
        self.groups: list[tuple[int, int, int]] = []  # (first row, file index, row group)
        row = 0
        for i, file in enumerate(files):
            try:
                pf = pq.ParquetFile(file)
            except (OSError, pa.ArrowException) as err:
                raise UsageError(f"{file}: not a readable Parquet file ({err})") from None
            self.parquet.append(pf)
            for g in range(pf.metadata.num_row_groups):
                self.groups.append((row, i, g))
                row += pf.metadata.row_group(g).num_rows
        self.rows = row
        if self.rows == 0:
            raise UsageError(f"{path}: no rows to score (an empty file)")
        self._cache: dict[tuple, pa.Table] = {}

    def schema(self, index: int) -> pa.Schema:
        return self.parquet[index].schema_arrow

    def read(self, start: int, stop: int, columns: list[str]) -> pa.Table:
        """Rows [start, stop) of `columns`."""
        parts = []
        for first, i, g in self.groups:
            size = self.parquet[i].metadata.row_group(g).num_rows
            if first + size <= start or first >= stop or size == 0:
                continue
            table = self._group(i, g, columns)
            lo, hi = max(start, first) - first, min(stop, first + size) - first
            parts.append(table.slice(lo, hi - lo))
        if not parts:
            return pa.table({c: pa.array([], type=pa.null()) for c in columns})
        return pa.concat_tables(parts) if len(parts) > 1 else parts[0]

    def _group(self, i: int, g: int, columns: list[str]) -> pa.Table:
        key = (i, g, tuple(columns))
        if key not in self._cache:
            if len(self._cache) >= 2:  # one row group ahead of the one a batch ends in
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = self.parquet[i].read_row_group(g, columns=columns)
        return self._cache[key]


def check_input(schema: Schema, files: InputFiles, key: str | None) -> None:
    """Every problem a rank would meet, found before any starts: a column missing or of the
    wrong type, a null, a list of the wrong length, an id outside its table. UsageError
    naming the file, the column and the row."""
    needed = list(schema.columns)
    for i, file in enumerate(files.files):
        arrow = files.schema(i)
        for name in [*needed, *([key] if key else [])]:
            if arrow.get_field_index(name) < 0:
                raise UsageError(
                    f"{file}: no column {name!r} (the model needs "
                    f"{', '.join(repr(n) for n in needed)}; see cleave score --print-schema)"
                )
        for name in needed:
            _check_type(file, schema.columns[name], arrow.field(name).type)
    widths: dict[str, int] = {}
    for first, i, g in files.groups:
        table = files.parquet[i].read_row_group(g, columns=needed)
        base = first - next(f for f, j, _ in files.groups if j == i)
        for name in needed:
            _check_values(files.files[i], schema.columns[name], table.column(name), base, widths)


def _check_type(file: Path, col: Column, got: pa.DataType) -> None:
    element = got.value_type if pa.types.is_list(got) or pa.types.is_large_list(got) else got
    is_list = element is not got
    ok_kind = pa.types.is_integer(element) if col.kind == "int" else pa.types.is_floating(element)
    if ok_kind and is_list == (col.width != 1):
        return
    raise UsageError(
        f"{file}: column {col.name!r} is {got}, expected {col.arrow_type} ({', '.join(col.feeds)})"
    )


def _check_values(file: Path, col: Column, data: pa.ChunkedArray, base: int, widths) -> None:
    arr = data.combine_chunks()
    if arr.null_count:
        row = base + int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise UsageError(f"{file}: column {col.name!r}, row {row}: null, a value expected")
    values, lengths = flat_values(arr)
    if lengths is not None:
        nulls = arr.flatten().null_count
        if nulls:
            lens = np.repeat(np.arange(len(lengths)), lengths)
            bad = np.flatnonzero(arr.flatten().is_null().to_numpy(zero_copy_only=False))[0]
            raise UsageError(
                f"{file}: column {col.name!r}, row {base + int(lens[bad])}: a null in the list"
            )
        want = col.width or (widths.get(col.name) if col.symbolic else None)
        if col.symbolic and want is None and len(lengths):
            want = widths[col.name] = int(lengths[0])
        if want is not None:
            wrong = np.flatnonzero(lengths != want)
            if len(wrong):
                row = base + int(wrong[0])
                raise UsageError(
                    f"{file}: column {col.name!r}, row {row}: {int(lengths[wrong[0]])} "
                    f"elements, expected {want} (every row the same)"
                )
    for feature, table, transform, rows in col.id_ranges:
        ids = apply_transform(values, transform)
        bad = np.flatnonzero((ids < 0) | (ids >= rows))
        if len(bad):
            k = int(bad[0])
            row = k if lengths is None else int(np.searchsorted(np.cumsum(lengths), k, "right"))
            raise UsageError(
                f"{file}: column {col.name!r}, row {base + row}: id {int(values[k])} "
                f"(after the feature's transform: {int(ids[k])}) is outside table {table!r}, "
                f"which has rows [0, {rows}) (feature {feature!r})"
            )


def flat_values(arr: pa.Array) -> tuple[np.ndarray, np.ndarray | None]:
    """A column's values flattened, and each row's length (None for a scalar column)."""
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        offsets = arr.offsets.to_numpy()
        values = arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        return values.to_numpy(zero_copy_only=False), np.diff(offsets)
    return arr.to_numpy(zero_copy_only=False), None


def apply_transform(ids: np.ndarray, transform: list) -> np.ndarray:
    """A feature's id transform (docs/bundle.md) on numpy ids: the reference executor's own
    (cleave.bundle.reference), so the two cannot drift apart."""
    if not transform:
        return ids
    import torch

    from cleave.bundle.reference import apply_transform as reference

    # Arrow's zero-copy arrays are read-only, which torch.from_numpy warns about: a copy.
    tensor = torch.from_numpy(np.require(ids, requirements="W"))
    return reference(tensor, transform).numpy()


def to_rows(schema: Schema, inputs: dict) -> pa.Table:
    """A batch of named model inputs (torch tensors, as `Bundle.named_inputs` gives) as the
    rows `cleave score` reads: the inverse of the column mapping, for exporting requests."""
    manifest = schema.manifest
    features = {f["name"]: f for f in manifest["features"]}
    kjts = {k["name"]: k for k in manifest.get("kjts", [])}
    columns: dict[str, pa.Array] = {}
    for f in schema.features:
        spec = features[f.name]
        if f.request_shape is not None:
            continue  # a request's whole input in each of its rows: below
        if spec["layout"] == "kjt":
            kjt = kjts[spec["kjt"]]
            k = kjt["keys"].index(spec["key"])
            lengths = inputs[kjt["lengths"]].numpy().reshape(len(kjt["keys"]), -1)
            start = int(lengths[:k].sum())
            offsets = start + np.concatenate([[0], np.cumsum(lengths[k])])
            sources = [(f.column, kjt["values"])]
            if f.weights:
                sources.append((f.weights, kjt["weights"]))
        elif spec["layout"] == "offsets":
            offsets = inputs[spec["offsets"]].numpy().astype(np.int64)
            n = len(inputs[spec["ids"]])
            offsets = offsets if spec.get("include_last_offset") else np.append(offsets, n)
            sources = [(f.column, spec["ids"])]
            if f.weights:
                sources.append((f.weights, spec["weights"]))
        else:
            continue  # a fixed bag or a gather: the input is already a row per sample
        for column, name in sources:
            values = pa.array(inputs[name].numpy().reshape(-1))
            columns[column] = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)
    for name, col in schema.columns.items():
        if name in columns or name in schema.request_columns:
            continue
        columns[name] = _rows_of(inputs[name].numpy(), col.width)
    rows = len(next(iter(columns.values())))
    for name in schema.request_columns:
        whole = inputs[name].numpy().reshape(1, -1)
        columns[name] = _rows_of(np.repeat(whole, rows, 0), schema.columns[name].width)
    return pa.table(columns)


def _rows_of(data: np.ndarray, width: int | None) -> pa.Array:
    """An array whose first dimension is the rows: a scalar column, or a list column."""
    rows = data.shape[0]
    flat = data.reshape(rows, -1)
    if width == 1:
        return pa.array(flat[:, 0])
    offsets = np.arange(rows + 1, dtype=np.int32) * flat.shape[1]
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.reshape(-1)))
