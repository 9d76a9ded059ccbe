"""`Bundle`: a model cut into sparse lookups (tables + features) and a dense program, the
same object whether it was just partitioned (tables in memory) or loaded from disk (tables
memory-mapped); docs/bundle.md describes the files. Needs torch: `cleave.bundle.manifest`
reads a bundle's metadata without it."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.utils._pytree as pytree

from cleave.bundle import graph as graph_io
from cleave.bundle import kjt as kjt_io
from cleave.bundle import manifest as manifest_io
from cleave.bundle import tables as table_io
from cleave.bundle.reference import run_sparse
from cleave.errors import BundleError, CleaveError

__all__ = ["Bundle", "load_bundle"]

log = logging.getLogger("cleave.bundle")

DENSE_PROGRAM = "dense.pt2"
DENSE_PROBE = "dense_probe.pt"  # a small batch of dense inputs and the float32 outputs
# The programs' GraphModules in a form read without torch.export (cleave.bundle.graph).
DENSE_GRAPH = "dense_graph.pt"
BATCHED_GRAPH = "dense_batched_graph.pt"


class Bundle:
    """A partitioned model. Build one with `cleave.partition`, or read one with `load_bundle`."""

    def __init__(
        self,
        manifest: dict,
        tables: dict[str, np.ndarray],
        dense: torch.export.ExportedProgram | None,
        path: Path | None = None,
        batched: torch.export.ExportedProgram | None = None,
        stored_graphs: bool = False,
    ):
        self.manifest = manifest
        self.path = path
        self._raw_tables = tables  # name -> uint8 [rows, row_bytes] (array or memmap)
        # None: not read yet (a bundle loaded with `stored_graphs` reads it when asked for).
        self._dense = dense
        # The same program over many requests' joined inputs (cleave.partitioner.batched).
        self._batched = batched
        # Build the float32 dense modules from the bundle's stored graphs where it has them.
        self._stored_graphs = stored_graphs
        self._decoded: dict[str, torch.Tensor] = {}
        self._dense_modules: dict[tuple[str, bool], torch.nn.Module] = {}
        # {"inputs": [...], "outputs": [...]}: set by the partitioner, read lazily from disk
        self._probe: dict | None = None

    # -- what is inside ----------------------------------------------------------------------
    @property
    def input_names(self) -> list[str]:
        return [i["name"] for i in self.manifest["inputs"]]

    @property
    def dense_program(self) -> torch.export.ExportedProgram:
        """The float32 dense program (see `dense_module` for the one served)."""
        if self._dense is None:
            self._dense = _load_program(self.path / self.manifest["dense"]["program"])
        return self._dense

    @property
    def batched_program(self) -> torch.export.ExportedProgram | None:
        """The dense program over joined requests, if the bundle has one."""
        name = (self.manifest["dense"].get("batched") or {}).get("program")
        if self._batched is None and name and self.path is not None:
            self._batched = _load_program(self.path / name)
        return self._batched

    @property
    def dense_dtype(self) -> str:
        """The precision the dense program is served at (cleave.bundle.precision)."""
        return self.manifest["dense"].get("dtype", "float32")

    def table(self, name: str) -> torch.Tensor:
        """A table decoded to fp32 [rows, dim] (int8 and fp16 dequantized)."""
        if name not in self._decoded:
            meta = self._table_meta(name)
            decoded = table_io.decode(
                np.asarray(self._raw_tables[name]), meta["dtype"], meta["dim"]
            )
            self._decoded[name] = torch.from_numpy(np.array(decoded, dtype=np.float32))
        return self._decoded[name]

    def _table_meta(self, name: str) -> dict:
        for meta in self.manifest["tables"]:
            if meta["name"] == name:
                return meta
        raise CleaveError(f"bundle has no table {name!r}")

    def summary(self) -> dict:
        """What was split: tables, bytes per side, boundary tensors and their bytes per sample."""
        table_bytes = sum(t["rows"] * t["row_bytes"] for t in self.manifest["tables"])
        dense_bytes = sum(
            t.numel() * t.element_size()
            for t in [*self.dense_program.parameters(), *self.dense_program.buffers()]
        )
        return {
            "tables": [
                {k: t[k] for k in ("name", "rows", "dim", "dtype")} for t in self.manifest["tables"]
            ],
            "features": len(self.manifest["features"]),
            "sparse_bytes": table_bytes,
            "dense_bytes": dense_bytes,
            "boundary": [_crossing(b) for b in self.manifest["boundary"]],
            "shared_inputs": self.manifest["shared_inputs"],
            "batched": self.manifest["dense"].get("batched"),
            "dense_dtype": self.dense_dtype,
            "dense_dtypes": self.manifest["dense"].get("dtypes"),
            "accuracy": self.manifest["dense"].get("accuracy"),
        }

    # -- running it ------------------------------------------------------------------------
    def named_inputs(self, *args) -> dict[str, torch.Tensor]:
        """The model's forward arguments -> tensors by manifest input name."""
        return kjt_io.named_inputs(self.input_names, args)

    def sparse_reference(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The boundary tensors of a request, computed with the reference executor."""
        return run_sparse(self.manifest, inputs, self.table)

    def dense_inputs(self, *args) -> list[torch.Tensor]:
        """The dense program's inputs, in manifest order, for the model's forward arguments:
        the sparse side by the reference executor."""
        inputs = self.named_inputs(*args)
        values = {**inputs, **self.sparse_reference(inputs)}
        return [values[n] for n in self.manifest["dense"]["inputs"]]

    @property
    def per_request_inputs(self) -> list[str]:
        return manifest_io.per_request_inputs(self.manifest)

    def dense_module(self, dtype: str | None = None, batched: bool = False) -> torch.nn.Module:
        """(*dense inputs, in manifest order) -> tuple of the model's flat outputs, at the
        bundle's dense dtype (or `dtype`: "float32" is the program as partitioned). `batched`:
        the program over joined requests, whose `per_request_inputs` have a row per sample."""
        from cleave.bundle.precision import convert

        dtype = dtype or self.dense_dtype
        if batched and not (self.manifest["dense"].get("batched") or {}).get("program"):
            raise CleaveError("the bundle has no batched dense program (no per-request inputs)")
        if (dtype, batched) not in self._dense_modules:
            if ("float32", batched) not in self._dense_modules:
                self._dense_modules["float32", batched] = self._float32_module(batched)
            layers = self.manifest["dense"].get("int8_layers")  # chosen by the partitioner
            self._dense_modules[dtype, batched] = convert(
                self._dense_modules["float32", batched], dtype, layers
            )
        return self._dense_modules[dtype, batched]

    def _float32_module(self, batched: bool) -> torch.nn.Module:
        """The program's GraphModule: from its stored graph (a bundle loaded with
        `stored_graphs` that has one), else from the torch.export program."""
        meta = self.manifest["dense"]["batched"] if batched else self.manifest["dense"]
        if self._stored_graphs and meta.get("graph") and self.path is not None:
            return graph_io.load(self.path / meta["graph"])
        program = self.batched_program if batched else self.dense_program
        return program.module()

    def keep_dense_modules(self, dtype: str) -> None:
        """Forgets the programs converted to dtypes other than `dtype` and float32 (a ranker's
        probe made them; only the one it chose is served)."""
        for key in [k for k in self._dense_modules if k[0] not in (dtype, "float32")]:
            del self._dense_modules[key]

    def record_probe(self, dense_inputs: list[torch.Tensor]) -> None:
        """Keeps `dense_inputs` and the float32 program's outputs on them as the probe."""
        with torch.inference_mode():
            outputs = [t.clone() for t in self.dense_module("float32")(*dense_inputs)]
        self._probe = {"inputs": [t.clone() for t in dense_inputs], "outputs": outputs}
        self.manifest["dense"]["probe"] = DENSE_PROBE

    def probe(self) -> dict | None:
        """The probe batch: dense inputs and the float32 program's outputs on them, recorded
        at partition time; a ranker checks the program it is about to serve against it.
        None for bundles partitioned before probes existed."""
        if self._probe is None and self.path is not None:
            file = self.path / DENSE_PROBE
            if self.manifest["dense"].get("probe") and file.exists():
                try:
                    self._probe = torch.load(file, weights_only=True)
                except Exception as err:
                    raise BundleError(f"{file}: cannot be read: {err}") from None
        return self._probe

    def run_dense(self, values: dict[str, torch.Tensor], dense=None) -> tuple:
        """The dense program (`dense_module()`, or `dense`) on the named values."""
        names = self.manifest["dense"]["inputs"]
        # `is None`, not `or`: a compiled module's truth value raises (it forwards len()).
        dense = self.dense_module() if dense is None else dense
        return tuple(dense(*[values[n] for n in names]))

    def reference(self, *args, dtype: str | None = None):
        """The model's outputs: the sparse side by the reference executor, then the dense
        program (at `dtype`, default the bundle's). Returns the same structure as the model's
        forward."""
        inputs = self.named_inputs(*args)
        values = {**inputs, **self.sparse_reference(inputs)}
        flat = self.run_dense(values, self.dense_module(dtype))
        spec = pytree.treespec_loads(self.manifest["output_spec"])
        return pytree.tree_unflatten(list(flat), spec)

    def full_module(self, dense: torch.nn.Module | None = None) -> torch.nn.Module:
        """The whole model in one module over the flat manifest inputs (the monolithic
        baseline): (*inputs) -> tuple of flat outputs. `dense`: the dense program to run
        (default `dense_module()`), a compiled one say."""
        return _FullModel(self, self.dense_module() if dense is None else dense)

    # -- files -------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, overwrite: bool = False) -> Path:
        """Writes the bundle atomically: to a temporary sibling directory, then renamed."""
        path = Path(path)
        if path.exists() and not overwrite:
            raise BundleError(f"{path} already exists; pass overwrite=True (CLI: --force)")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            (tmp / "tables").mkdir()
            for meta in self.manifest["tables"]:
                raw = np.ascontiguousarray(self._raw_tables[meta["name"]])
                (tmp / meta["file"]).write_bytes(raw.tobytes())
            torch.export.save(self.dense_program, tmp / DENSE_PROGRAM)
            if self.batched_program is not None:
                batched = self.manifest["dense"]["batched"]
                torch.export.save(self.batched_program, tmp / batched["program"])
            if self.probe() is not None:
                torch.save(self.probe(), tmp / DENSE_PROBE)
            self._save_graphs(tmp)
            manifest_io.write(tmp, self.manifest)
            if path.exists():
                old = path.with_name(f".{path.name}.old-{os.getpid()}")
                path.rename(old)
                tmp.rename(path)
                shutil.rmtree(old)
            else:
                tmp.rename(path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.path = path
        return path

    def _save_graphs(self, directory: Path) -> None:
        """Writes each program's stored graph beside it (cleave.bundle.graph), checked against
        the program; one that the form cannot hold is left out (rankers read the archive)."""
        dense = self.manifest["dense"]
        programs = [(dense, self.dense_program, DENSE_GRAPH, self.probe())]
        if self.batched_program is not None:
            programs.append((dense["batched"], self.batched_program, BATCHED_GRAPH, None))
        for meta, program, name, probe in programs:
            meta.pop("graph", None)
            try:
                data = graph_io.stored(program, probe and probe["inputs"])
            except graph_io.GraphUnsupported as err:
                log.info("%s: no stored graph (rankers will read the archive): %s", name, err)
                continue
            (directory / name).write_bytes(data)
            meta["graph"] = name


def load_bundle(
    path: str | os.PathLike, verify: bool = True, stored_graphs: bool = False
) -> Bundle:
    """Reads a bundle; `verify` checks every table's CRC-32 (reads all table bytes).
    `stored_graphs`: the dense modules are built from the bundle's stored graphs
    (cleave.bundle.graph) where it has them, and the torch.export programs are read only if
    asked for: a ranker's start, without torch.export's imports."""
    path = Path(path)
    manifest = manifest_io.read(path)
    tables = {}
    for meta in manifest["tables"]:
        file = path / meta["file"]
        tables[meta["name"]] = table_io.open_rows(file, meta)
        if verify and table_io.crc32_of(file) != meta["crc32"]:
            raise BundleError(
                f"{file}: CRC-32 mismatch for table {meta['name']!r}: the file is corrupted"
            )
    if stored_graphs:
        return Bundle(manifest, tables, None, path, stored_graphs=True)
    dense = _load_program(path / manifest["dense"]["program"])
    batched = (manifest["dense"].get("batched") or {}).get("program")
    batched = _load_program(path / batched) if batched else None
    return Bundle(manifest, tables, dense, path, batched)


def _load_program(program: Path) -> torch.export.ExportedProgram:
    try:
        return torch.export.load(program)
    except FileNotFoundError:
        raise BundleError(f"{program}: the dense program is missing") from None
    except Exception as err:  # torch raises many types for a damaged archive
        raise BundleError(f"{program}: cannot load the dense program: {err}") from None


def _crossing(tensor: dict) -> dict:
    """How much of a boundary tensor crosses: bytes per sample (or per request, for a tensor
    looked up once per request), times any sizes that vary per request."""
    itemsize = torch.empty((), dtype=getattr(torch, tensor["dtype"])).element_size()
    rest = tensor["shape"][1:]
    static = int(np.prod([d for d in rest if isinstance(d, int)], dtype=np.int64)) * itemsize
    return {
        "name": tensor["name"],
        "shape": tensor["shape"],
        "bytes": static,
        "per": "request" if tensor["shape"][:1] == [1] else "sample",
        "times": [d for d in rest if isinstance(d, str)],
    }


class _FullModel(torch.nn.Module):
    def __init__(self, bundle: Bundle, dense: torch.nn.Module):
        super().__init__()
        self.bundle = bundle
        self.dense = dense
        for name in {f["table"] for f in bundle.manifest["features"]}:
            bundle.table(name)  # decode once, up front

    def forward(self, *inputs: torch.Tensor) -> tuple:
        named = dict(zip(self.bundle.input_names, inputs, strict=True))
        return self.bundle.run_dense({**named, **self.bundle.sparse_reference(named)}, self.dense)
