"""What a ranker knows about the tensors it receives: names, dtypes, shapes from the bundle
manifest, and how requests are joined into one batch and split again.

Joining rules, per input (chosen from the manifest, never from the model's code):
* `batch`: leading dim is the batch symbol "B" -> concatenated along dim 0;
* `jagged`: ids / per-sample weights of an `offsets`-layout feature, and a KJT key's rows read
  row by row (a `kjt` feature with pooling "none"; its lengths cross cut by key, [B], and
  join as `batch`) -> concatenated along dim 0;
* `offsets`: the offsets of such a feature -> concatenated with each request's offsets shifted
  by the ids that came before (with include_last_offset, the inner end markers are dropped);
* `expand`: a per-request input (a shared user's leading size of 1) of a bundle with a
  batched program (cleave.partitioner.batched) -> each request's tensor expanded to its rows,
  then concatenated: the broadcast the program did per request, done per request before
  joining;
* anything else (a per-request input without a batched program, or another symbol) cannot be
  joined across requests, so such a model runs one request per batch.
Outputs are split by their leading "B" rows; a model with any other output runs one request
per batch as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cleave.bundle.manifest import per_request_inputs, reads_rows
from cleave.ranker.payload import DTYPE_NAMES, PayloadError, RankRequest

BATCH = "B"


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: torch.dtype
    shape: tuple  # ints (static) and strs (symbols)
    join: str  # "batch" | "jagged" | "offsets" | "expand" | "none"
    ids: str | None = None  # for join == "offsets": the ids input whose lengths shift them
    include_last_offset: bool = False


@dataclass(frozen=True)
class Signature:
    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]
    batchable: bool  # requests can be concatenated into one batch
    why_not: str  # when not batchable: which tensor prevents it

    def check(self, request: RankRequest) -> int:
        """Validates a decoded request against the manifest; returns its batch rows."""
        tensors = request.tensors
        if len(tensors) != len(self.inputs):
            raise PayloadError(
                f"expected {len(self.inputs)} tensors ({', '.join(s.name for s in self.inputs)}),"
                f" got {len(tensors)}"
            )
        symbols: dict[str, tuple[int, str]] = {}
        for spec, tensor in zip(self.inputs, tensors, strict=True):
            if tensor.dtype != spec.dtype:
                raise PayloadError(
                    f"input {spec.name!r}: expected {spec.dtype}, got {tensor.dtype}"
                )
            if tensor.dim() != len(spec.shape):
                raise PayloadError(
                    f"input {spec.name!r}: expected {len(spec.shape)} dims {list(spec.shape)}, "
                    f"got shape {list(tensor.shape)}"
                )
            for axis, (want, got) in enumerate(zip(spec.shape, tensor.shape, strict=True)):
                if isinstance(want, int):
                    if want != got:
                        raise PayloadError(
                            f"input {spec.name!r} dim {axis}: expected {want}, got {got}"
                        )
                elif want in symbols and symbols[want][0] != got:
                    size, other = symbols[want]
                    raise PayloadError(
                        f"input {spec.name!r} dim {axis} ({want}) is {got}, "
                        f"but {other} has {want} = {size}"
                    )
                else:
                    symbols.setdefault(want, (got, f"input {spec.name!r}"))
        return self.rows(tensors)

    def rows(self, tensors: list[torch.Tensor]) -> int:
        """Batch rows of one request: what max_batch counts and outputs are split by."""
        for spec, tensor in zip(self.inputs, tensors, strict=True):
            if spec.join == "batch":
                return int(tensor.shape[0])
        for spec, tensor in zip(self.inputs, tensors, strict=True):
            if spec.join == "offsets":
                return int(tensor.shape[0]) - int(spec.include_last_offset)
        return 1

    def example(self, rows: int) -> list[torch.Tensor] | None:
        """Zero inputs of `rows` rows (empty bags), for warming up; None when some size other
        than the batch or a bag length is symbolic."""
        tensors = []
        for spec in self.inputs:
            rest = spec.shape[1:]
            if not all(isinstance(d, int) for d in rest):
                return None
            if spec.join in ("batch", "expand"):
                size = rows
            elif spec.join == "jagged":
                size = 0
            elif spec.join == "offsets":
                size = rows + int(spec.include_last_offset)
            elif spec.shape and isinstance(spec.shape[0], int):
                size = spec.shape[0]
            else:
                return None
            tensors.append(
                torch.zeros((size, *rest), dtype=spec.dtype)
                if spec.shape
                else torch.zeros((), dtype=spec.dtype)
            )
        return tensors

    def join(self, requests: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Concatenates several requests' tensors into one batch (see the module docstring)."""
        expands = any(spec.join == "expand" for spec in self.inputs)
        if len(requests) == 1 and not expands:
            return requests[0]
        rows = [self.rows(tensors) for tensors in requests] if expands else []
        index = {spec.name: i for i, spec in enumerate(self.inputs)}
        joined = []
        for i, spec in enumerate(self.inputs):
            parts = [tensors[i] for tensors in requests]
            if spec.join == "expand":
                parts = [t.expand(n, *t.shape[1:]) for t, n in zip(parts, rows, strict=True)]
            elif spec.join == "offsets":
                parts = _shift_offsets(
                    parts, [t[index[spec.ids]].shape[0] for t in requests], spec.include_last_offset
                )
            joined.append(torch.cat(parts))
        return joined

    def split(self, outputs: list[torch.Tensor], rows: list[int]) -> list[list[torch.Tensor]]:
        """Cuts a batch's outputs back into each request's rows."""
        if len(rows) == 1:
            return [list(outputs)]
        pieces = [torch.split(out, rows) for out in outputs]
        return [[piece[r] for piece in pieces] for r in range(len(rows))]


def _shift_offsets(
    parts: list[torch.Tensor], id_counts: list[int], include_last: bool
) -> list[torch.Tensor]:
    shifted, base = [], 0
    for n, (offsets, count) in enumerate(zip(parts, id_counts, strict=True)):
        last = n == len(parts) - 1
        # With include_last_offset each request ends with its own end marker; only the last
        # request's marker survives in the joined tensor.
        piece = offsets[:-1] if include_last and not last else offsets
        shifted.append(piece + base if base else piece)
        base += int(count)
    return shifted


def _shape(raw: list) -> tuple:
    return tuple(d if isinstance(d, int) else str(d) for d in raw)


def signature(manifest: dict, monolithic: bool, batched: bool = False) -> Signature:
    """The signature of the dense program (RANK) or of the whole model (RANK_FULL);
    `batched`: of the bundle's batched dense program, which joins per-request inputs."""
    tensors = {t["name"]: t for t in manifest.get("inputs", [])}
    tensors.update({t["name"]: t for t in manifest.get("boundary", [])})
    names = (
        [t["name"] for t in manifest["inputs"]] if monolithic else list(manifest["dense"]["inputs"])
    )
    jagged: dict[str, dict] = {}
    offsets: dict[str, dict] = {}
    for feature in manifest.get("features", []):
        if feature.get("layout") == "offsets":
            jagged[feature["ids"]] = feature
            if feature.get("weights"):
                jagged[feature["weights"]] = feature
            offsets[feature["offsets"]] = feature
        elif reads_rows(feature):
            jagged[feature["output"]] = feature  # a KJT key's rows
    shared = set(manifest.get("shared_inputs", []))
    per_request = set(per_request_inputs(manifest)) if batched and not monolithic else set()
    specs, why_not = [], ""
    for name in names:
        meta = tensors.get(name)
        if meta is None:
            raise PayloadError(f"manifest names dense input {name!r} but describes no such tensor")
        dtype = DTYPE_NAMES.get(meta["dtype"])
        if dtype is None:
            raise PayloadError(f"tensor {name!r} has dtype {meta['dtype']!r}, not a wire dtype")
        shape = _shape(meta["shape"])
        spec = InputSpec(name, dtype, shape, "none")
        if name in per_request:
            spec = InputSpec(name, dtype, shape, "expand")
        elif name in shared:
            pass  # one user per request: never joined with another request's user
        elif name in offsets and name in names and offsets[name]["ids"] in names:
            feature = offsets[name]
            spec = InputSpec(
                name, dtype, shape, "offsets", feature["ids"], feature.get("include_last_offset")
            )
        elif name in jagged and len(shape) == 1 and jagged[name]["offsets"] in names:
            spec = InputSpec(name, dtype, shape, "jagged")
        elif name in jagged and jagged[name]["output"] == name:
            spec = InputSpec(name, dtype, shape, "jagged")
        elif shape and shape[0] == BATCH:
            spec = InputSpec(name, dtype, shape, "batch")
        if spec.join == "none" and not why_not:
            why_not = f"input {name!r} has shape {list(shape)}, which cannot be joined"
        specs.append(spec)
    outputs = []
    for out in manifest.get("outputs", []):
        outputs.append(out["name"])
        if not why_not and (not out["shape"] or out["shape"][0] != BATCH):
            why_not = f"output {out['name']!r} has shape {out['shape']}, not split by rows"
    if not any(s.join in ("batch", "offsets") for s in specs) and not why_not:
        why_not = "no input carries the batch dimension"
    return Signature(tuple(specs), tuple(outputs), not why_not, why_not)
