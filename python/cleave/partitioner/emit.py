"""Turning a seam into a bundle: the manifest, the table files and the dense program."""

from __future__ import annotations

import hashlib
import re
import zlib

import numpy as np
import sympy
import torch
import torch.utils._pytree as pytree
from torch import fx

from cleave.bundle import Bundle
from cleave.bundle import kjt as kjt_io
from cleave.bundle import tables as table_io
from cleave.bundle.manifest import FORMAT, VERSION, reads_rows
from cleave.bundle.reference import run_sparse
from cleave.errors import UnsupportedModelError
from cleave.partitioner import fbgemm
from cleave.partitioner.batched import BATCHED_PROGRAM, export_batched, per_request_inputs
from cleave.partitioner.capture import KjtInput, dense_shapes
from cleave.partitioner.graph import Lookup, Seam

aten = torch.ops.aten


def emit(
    ep: torch.export.ExportedProgram,
    args: tuple,
    names: list[str],
    seam: Seam,
    table_dtype: str,
    kjts: list[KjtInput] = (),
) -> Bundle:
    """`names`: the model's flat input names, in export's user-input order; `kjts`: the
    KeyedJaggedTensor arguments among them."""
    table_io.row_bytes(table_dtype, 1)  # validates the dtype name early
    sig = ep.graph_signature
    output = next(n for n in ep.graph.nodes if n.op == "output")
    by_name = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    # A KJT's absent fields (offsets, weights, ...) are None among the user inputs.
    users = [by_name[n] for n in sig.user_inputs if n is not None]
    placeholders = dict(zip(names, users, strict=True))
    input_name = {node: name for name, node in placeholders.items()}
    state = {**ep.state_dict, **ep.constants}
    sources = {
        **sig.inputs_to_parameters,
        **sig.inputs_to_buffers,
        **sig.inputs_to_lifted_tensor_constants,
    }
    symbols = _SymbolNames(output)

    # Tables: one per weight that some lookup reads; features sharing a weight share a table.
    tables, raw_tables, table_of = [], {}, {}
    for lk in seam.lookups:
        if lk.table.name in table_of:
            continue
        source = sources[lk.table.name]
        name = _unique(re.sub(r"\W", "_", source.removesuffix(".weight")), raw_tables)
        weight = state[source].detach().to(torch.float32).contiguous().numpy()
        if weight.ndim != 2:
            raise UnsupportedModelError(f"table {source!r} must be 2-D, has shape {weight.shape}")
        raw_tables[name] = table_io.encode(weight, table_dtype)
        tables.append(
            {
                "name": name,
                "file": f"tables/{name}.bin",
                "rows": int(weight.shape[0]),
                "dim": int(weight.shape[1]),
                "dtype": table_dtype,
                "row_bytes": table_io.row_bytes(table_dtype, int(weight.shape[1])),
                "crc32": _crc32(raw_tables[name]),
                "sha256": _sha256(raw_tables[name]),
                "source": source,
            }
        )
        table_of[lk.table.name] = name

    features, boundary = [], []
    for lk in seam.lookups:
        base = lk.kjt.name if lk.kjt else input_name[lk.ids]
        name = _unique(base, {f["name"] for f in features})
        features.append(_feature(name, lk, table_of, input_name))
        boundary.append(
            {
                "name": features[-1]["output"],
                "dtype": "float32",
                "shape": symbols.shape(lk.output.meta["val"].shape),
            }
        )

    needed = set(seam.dense_nodes) | {a for n in seam.dense_nodes for a in n.all_input_nodes}
    needed |= set(output.all_input_nodes)
    # A KJT's lengths that the dense side reads (an EmbeddingCollection's) cross cut by key.
    cut = {
        k.input("lengths"): _lengths_by_key(k)
        for k in kjts
        if placeholders.get(k.input("lengths")) in needed
    }
    for n, by_key in cut.items():
        dtype = _dtype(placeholders[n].meta["val"].dtype)
        boundary += [{"name": name, "dtype": dtype, "shape": ["B"]} for name in by_key]
    dense_model_inputs = [n for n in names if placeholders[n] in needed and n not in cut]
    dense_inputs = dense_model_inputs + [b["name"] for b in boundary]

    roles = {n: set() for n in names}
    for f in features:
        for role in ("ids", "offsets", "weights", "lengths"):
            if f.get(role):
                roles[f[role]].add(role)
    for n in dense_model_inputs:
        roles[n].add("dense")
    inputs = [
        {
            "name": n,
            "dtype": _dtype(placeholders[n].meta["val"].dtype),
            "shape": symbols.shape(placeholders[n].meta["val"].shape),
            "role": _role(roles[n]),
        }
        for n in names
    ]
    flat_outputs = [a for a in pytree.tree_leaves(output.args[0]) if isinstance(a, fx.Node)]
    outputs = [
        {
            "name": f"output_{i}",
            "dtype": _dtype(n.meta["val"].dtype),
            "shape": symbols.shape(n.meta["val"].shape),
        }
        for i, n in enumerate(flat_outputs)
    ]
    shared = _shared_inputs(seam.lookups, features, symbols)

    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "producer": f"cleave {_version()}",
        "inputs": inputs,
        "outputs": outputs,
        "output_spec": pytree.treespec_dumps(ep.call_spec.out_spec),
        "tables": tables,
        "features": features,
        "boundary": boundary,
        "dense": {"program": "dense.pt2", "inputs": dense_inputs},
        "shared_inputs": shared,
        "kjts": [_kjt_meta(k, cut.get(k.input("lengths"), [])) for k in kjts],
        "partition": {"dense_ops": len(seam.dense_nodes), "from_seeds": seam.seeded},
    }

    # The dense program: the dense operators, fed by the dense model inputs and the boundary.
    node_of = {n: placeholders[n] for n in dense_model_inputs}
    node_of.update({f["output"]: lk.output for f, lk in zip(features, seam.lookups, strict=True)})
    cut_nodes = {placeholders[n]: by_key for n, by_key in cut.items()}
    module = _dense_module(
        ep, seam, [node_of.get(n) for n in dense_inputs], dense_inputs, sources, cut_nodes
    )
    example = dict(zip(names, kjt_io.flat_tensors(args), strict=True))
    fp32_tables = {t["name"]: state[t["source"]].detach().to(torch.float32) for t in tables}
    crossing = run_sparse(manifest, example, fp32_tables.__getitem__)
    dense_args = tuple(example[n] if n in example else crossing[n] for n in dense_inputs)
    export_args = _sized_for_export(
        manifest, example, dict(zip(dense_inputs, dense_args, strict=True))
    )
    shapes = {t["name"]: t["shape"] for t in [*inputs, *boundary]}
    spec = dense_shapes(export_args, [shapes[n] for n in dense_inputs], named_batch=bool(cut))
    try:
        with torch.no_grad():
            program = torch.export.export(module, export_args, dynamic_shapes=spec)
    except Exception as err:
        raise UnsupportedModelError(f"the dense side could not be exported: {err}") from err
    batched, per_request = None, per_request_inputs(manifest)
    if per_request:  # requests of a model with shared inputs: can they share a batch?
        batched, why_not = export_batched(module, dense_inputs, dense_args, per_request)
        manifest["dense"]["batched"] = {
            "program": BATCHED_PROGRAM if batched else None,
            "per_request": per_request,
            **({} if batched else {"reason": why_not}),
        }
    return Bundle(manifest, raw_tables, program, batched=batched)


def _sized_for_export(manifest: dict, example: dict, args: dict) -> tuple:
    """The dense program's example for export: the partition example's, but where a KJT key
    read row by row has fewer than 2 ids there, every bag of that KJT gets 2 ids (of zero
    rows): export pins a size of 0 or 1 it sees, and only sizes matter to it."""
    unpooled = [f for f in manifest["features"] if reads_rows(f)]
    few = {f["kjt"] for f in unpooled if args[f["output"]].shape[0] < 2}
    for k in (k for k in manifest["kjts"] if k["name"] in few):
        batch = example[k["lengths"]].numel() // len(k["keys"])
        for name in k.get("lengths_by_key", []):
            args[name] = torch.full_like(args[name], 2)
        for f in (f for f in unpooled if f["kjt"] == k["name"]):
            rows = args[f["output"]]
            args[f["output"]] = rows.new_zeros(2 * batch, rows.shape[1])
    return tuple(args.values())


def _dense_module(ep, seam: Seam, input_nodes, input_names, sources, cut) -> fx.GraphModule:
    """`input_nodes`: the node each input stands for (None: a KJT's lengths of one key);
    `cut`: each KJT lengths node the dense side reads, and the names of its keys' lengths."""
    graph = fx.Graph()
    root = torch.nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    by_name = {}
    for node, name in zip(input_nodes, input_names, strict=True):
        by_name[name] = graph.placeholder(re.sub(r"\W", "_", name))  # `p.lengths.k`: p_lengths_k
        if node is not None:
            env[node] = by_name[name]
    for node, by_key in cut.items():  # the KJT's lengths, key-major, as the model reads them
        env[node] = graph.call_function(torch.cat, ([by_name[n] for n in by_key],))
    state = {**ep.state_dict, **ep.constants}
    params = set(ep.graph_signature.inputs_to_parameters)
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node not in env and node.name in sources:
            value = state[sources[node.name]].detach()
            attr = re.sub(r"\W", "_", sources[node.name])
            if node.name in params:
                root.register_parameter(attr, torch.nn.Parameter(value, requires_grad=False))
            else:
                root.register_buffer(attr, value)
            env[node] = graph.get_attr(attr)
    for node, value in seam.folded.items():
        root.register_buffer(f"_folded_{node.name}", value)
        env[node] = graph.get_attr(f"_folded_{node.name}")
    for node in seam.dense_nodes:
        if node in env:
            continue
        if node in seam.row_counts:
            env[node] = graph.call_function(aten.sym_size.int, (env[seam.row_counts[node]], 0))
            continue
        aten_form = fbgemm.decomposition(node) if fbgemm.is_fbgemm(node) else None
        if aten_form is not None:  # traced into ATen operators when the module is exported
            args = fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
            env[node] = graph.call_function(aten_form, *args)
        else:
            env[node] = graph.node_copy(node, lambda a: env[a])
    output = next(n for n in ep.graph.nodes if n.op == "output")
    flat = pytree.tree_leaves(output.args[0])
    graph.output(tuple(env[a] if isinstance(a, fx.Node) else a for a in flat))
    graph.eliminate_dead_code()
    module = fx.GraphModule(root, graph)
    for name, _ in list(module.named_parameters()) + list(module.named_buffers()):
        if not any(n.op == "get_attr" and n.target == name for n in graph.nodes):
            delattr(module, name)  # tables and weights only the sparse side reads
    return module


def _feature(name: str, lk: Lookup, table_of: dict, input_name: dict) -> dict:
    if lk.kjt is not None:  # key k's segment of a KJT (docs/bundle.md, "kjts")
        rows = lk.pooling == "none"  # an EmbeddingCollection's: the key's rows, unpooled
        return {
            "name": name,
            "table": table_of[lk.table.name],
            "ids": input_name[lk.ids],
            "transform": [],
            "layout": "kjt",
            "kjt": lk.kjt.kjt.name,
            "key": lk.kjt.name,
            "lengths": input_name[lk.kjt.lengths],
            "offsets": None,
            "include_last_offset": False,
            "weights": input_name[lk.weights] if lk.weights is not None else None,
            "pooling": lk.pooling,
            "output": f"{name}_{'rows' if rows else 'pooled'}",
        }
    return {
        "name": name,
        "table": table_of[lk.table.name],
        "ids": input_name[lk.ids],
        "transform": lk.transform,
        "layout": lk.layout,
        "offsets": input_name[lk.offsets] if lk.offsets is not None else None,
        "include_last_offset": lk.include_last_offset,
        "weights": input_name[lk.weights] if lk.weights is not None else None,
        "pooling": lk.pooling,
        "output": f"{name}_{'rows' if lk.layout == 'gather' else 'pooled'}",
    }


def _kjt_meta(kjt: KjtInput, lengths_by_key: list[str]) -> dict:
    return {
        "name": kjt.name,
        "keys": list(kjt.keys),
        **{field: kjt.input(field) if field in kjt.fields else None for field in kjt_io.FIELDS},
        **({"lengths_by_key": lengths_by_key} if lengths_by_key else {}),
    }


def _lengths_by_key(kjt: KjtInput) -> list[str]:
    return [f"{kjt.input('lengths')}.{key}" for key in kjt.keys]


def _shared_inputs(lookups: list[Lookup], features: list[dict], symbols) -> list[str]:
    """Inputs looked up once per request: their lookups have a batch of exactly 1 while the
    model's batch varies, so the dense side broadcasts them against the candidates."""
    if symbols.batch is None:
        return []
    shared = []
    for lk, f in zip(lookups, features, strict=True):
        if lk.kjt is None and lk.output.meta["val"].shape[0] == 1:  # a KJT has one batch
            shared += [f[k] for k in ("ids", "offsets", "weights") if f[k] and f[k] not in shared]
    return shared


class _SymbolNames:
    """Readable names for export's size symbols: B for the batch, N0, N1, ... for the rest."""

    def __init__(self, output: fx.Node):
        self.names: dict = {}
        self.batch = None
        first = next(
            (a for a in pytree.tree_leaves(output.args[0]) if isinstance(a, fx.Node)), None
        )
        if first is not None and len(first.meta["val"].shape) > 0:
            dim = first.meta["val"].shape[0]
            if isinstance(dim, torch.SymInt) and dim.node.expr.is_Symbol:
                self.batch = dim.node.expr
                self.names[self.batch] = "B"

    def shape(self, shape) -> list:
        out = []
        for dim in shape:
            if isinstance(dim, int):
                out.append(dim)
                continue
            expr = dim.node.expr
            if expr.is_Integer:
                out.append(int(expr))
                continue
            for sym in sorted(expr.free_symbols, key=str):
                self.names.setdefault(sym, f"N{len(self.names) - (self.batch is not None)}")
            out.append(str(expr.subs({s: sympy.Symbol(n) for s, n in self.names.items()})))
        return out


def _role(roles: set[str]) -> str:
    if "dense" in roles:
        return "both" if len(roles) > 1 else "dense"
    return sorted(roles)[0] if roles else "unused"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _unique(name: str, taken) -> str:
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}_{i}", i + 1
    return candidate


def _crc32(raw: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(raw).data)


def _sha256(raw: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(raw).data).hexdigest()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cleave")
    except PackageNotFoundError:
        return "dev"
