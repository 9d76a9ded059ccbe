"""Finding the seam in an exported graph (Prism §4.1, adapted to an explicit sparse op set).

1. The sparse frontier: every embedding operator (embedding_bag, or embedding followed by a
   pooling reduction or used per position), with the id transforms feeding it. Each becomes a
   `Lookup`, the unit a native engine runs. Anything upstream of a lookup that the engine cannot
   run is an error naming the operator.
2. Dense colouring: from the dense seeds (linear, matmul, bmm, attention) a depth-first search
   runs upstream and downstream until it meets the frontier. Operators it does not reach but
   the outputs need (glue such as cat or view) are attached to the dense side too: the sparse
   side runs only its explicit op set.
3. Constant subgraphs (no model input, no parameter) are folded once, at partition time.

A TorchRec KeyedJaggedTensor (KJT) reaches its lookups as segments: key k's ids are
`split_with_sizes(values, per-key length sums)[k]`, its offsets `cumsum(lengths[k])` after a
zero. Those two patterns (kjt.py) are recognised as "key k of the KJT"; the router cuts the
segments natively from `values` and `lengths` (docs/partitioning.md, "TorchRec models"). A key
read row by row (EmbeddingCollection) crosses as its rows; fbgemm operators on the dense side
are replaced by ATen where fbgemm.py knows how, and refused otherwise.

Sizes are compared on the example inputs' sizes (Prism's size-aware transfer): an embedding
read per position whose poolings together would be larger than its rows crosses unpooled.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from cleave.errors import UnsupportedModelError
from cleave.partitioner.kjt import (
    KjtFields,
    KjtKey,
    key_size,
    kjt_bag,
    kjt_rows,
    refuse_fbgemm,
)
from cleave.partitioner.nodes import op_name, where

aten = torch.ops.aten

EMBEDDING_BAG_OPS = {
    aten.embedding_bag.default,
    aten.embedding_bag.padding_idx,
    aten._embedding_bag.default,
    aten._embedding_bag_forward_only.default,
}
EMBEDDING_OPS = {aten.embedding.default}
DENSE_SEEDS = {
    aten.linear.default,
    aten.matmul.default,
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten.einsum.default,
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._native_multi_head_attention.default,
}
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout}
_PASSTHROUGH = {aten.alias.default, aten.clone.default, aten.contiguous.default}
_FLATTEN = {aten.reshape.default, aten.view.default, aten.flatten.using_ints}
_REMAINDER = {aten.remainder.Scalar: "remainder", aten.fmod.Scalar: "fmod"}
_POOLINGS = {
    aten.sum.dim_IntList: "sum",
    aten.mean.dim: "mean",
    aten.amax.default: "max",
    aten.max.dim: "max",
}
_BAG_MODES = {0: "sum", 1: "mean", 2: "max"}
_NOT_FOLDABLE = {"rand", "randn", "randint", "bernoulli", "normal", "dropout", "uniform"}


@dataclass
class Lookup:
    """One feature: a lookup (and pooling) the sparse side runs natively."""

    output: fx.Node  # the node whose value crosses the seam
    table: fx.Node  # the weight placeholder
    ids: fx.Node  # a user-input placeholder
    layout: str  # offsets | fixed | gather
    pooling: str  # sum | mean | max | none
    transform: list[dict] = field(default_factory=list)
    offsets: fx.Node | None = None
    weights: fx.Node | None = None
    include_last_offset: bool = False
    kjt: KjtKey | None = None  # layout "kjt": which KJT and key (rows when pooling "none")


@dataclass
class Seam:
    lookups: list[Lookup]
    dense_nodes: list[fx.Node]  # in graph order
    folded: dict[fx.Node, torch.Tensor]  # constant subgraph results, computed once
    seeded: int  # dense operators reached from the seeds (the rest were attached)
    # Dense nodes that count a KJT key's ids, and the lookup whose rows that many are: the
    # dense program reads the count off the rows (the ids stay on the sparse side).
    row_counts: dict[fx.Node, fx.Node] = field(default_factory=dict)


def size_hint(value) -> int:
    if isinstance(value, int):
        return value
    node = value.node
    hint = getattr(node, "hint", None)
    return int(hint) if hint is not None else int(node.shape_env.size_hint(node.expr))


def find_seam(ep: torch.export.ExportedProgram, kjts: KjtFields | None = None) -> Seam:
    """`kjts`: the placeholders that are fields of KJT arguments (kjt.py)."""
    kjts = kjts or {}
    graph = ep.graph
    sig = ep.graph_signature
    params = set(sig.inputs_to_parameters) | set(sig.inputs_to_buffers)
    user_inputs = set(sig.user_inputs)
    _reject_lookups_under_control_flow(ep)

    lookups: list[Lookup] = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in EMBEDDING_BAG_OPS:
            lookups.append(_bag_lookup(node, params, user_inputs, kjts))
        elif node.target in EMBEDDING_OPS:
            found = kjt_rows(node, kjts) if kjts else None
            if found is not None:  # TorchRec's EmbeddingCollection: the key's rows cross
                values, key = found
                table = _table(node.args[0], params, node)
                lookups.append(Lookup(node, table, values, "kjt", "none", kjt=key))
            else:
                lookups.extend(_embedding_lookups(node, params, user_inputs))
    if not lookups:
        raise UnsupportedModelError(
            "the model has no embedding operator (nn.EmbeddingBag, nn.Embedding, "
            "F.embedding_bag or F.embedding on a weight parameter): there is no sparse side to "
            "serve; serve it as a plain PyTorch model instead"
        )

    frontier = {lk.output for lk in lookups}
    output = next(n for n in graph.nodes if n.op == "output")
    needed = _needed_by_outputs(output, frontier)
    seeded = _colour_from_seeds(graph, frontier) & needed
    folded = _fold_constants(ep, needed)
    dense_nodes = [n for n in graph.nodes if n in needed and n.op == "call_function"]
    unpooled = [lk for lk in lookups if lk.kjt and lk.pooling == "none"]
    refuse_fbgemm(dense_nodes, [lk.output for lk in unpooled])
    rows_of = {(lk.kjt.kjt, lk.kjt.index): lk.output for lk in unpooled}
    counted = {n: key_size(n, kjts) for n in dense_nodes} if unpooled else {}
    row_counts = {n: rows_of[k] for n, k in counted.items() if k in rows_of}
    # A lookup whose result nothing reads is not served.
    read = {a for n in [*needed, output] for a in n.all_input_nodes}
    lookups = [lk for lk in lookups if lk.output in read]
    return Seam(lookups, dense_nodes, folded, len(seeded), row_counts)


def _needed_by_outputs(output: fx.Node, frontier: set[fx.Node]) -> set[fx.Node]:
    """Nodes the outputs need, cutting at the frontier (whose values cross the seam)."""
    needed: set[fx.Node] = set()
    stack = list(output.all_input_nodes)
    while stack:
        node = stack.pop()
        if node in needed or node in frontier:
            continue
        needed.add(node)
        stack.extend(node.all_input_nodes)
    return needed


def _colour_from_seeds(graph: fx.Graph, frontier: set[fx.Node]) -> set[fx.Node]:
    """Prism's DFS colouring: from the dense seeds, upstream and downstream, stopping at the
    sparse frontier."""
    seeds = [n for n in graph.nodes if n.op == "call_function" and n.target in DENSE_SEEDS]
    coloured: set[fx.Node] = set()
    stack = list(seeds)
    while stack:
        node = stack.pop()
        if node in coloured or node in frontier or node.op != "call_function":
            continue
        coloured.add(node)
        stack.extend(node.all_input_nodes)
        stack.extend(node.users)
    return coloured


# -- the sparse frontier ---------------------------------------------------------------------
def _table(weight: fx.Node, params: set[str], lookup: fx.Node) -> fx.Node:
    if weight.op == "placeholder" and weight.name in params:
        return weight
    raise UnsupportedModelError(
        f"the table of {op_name(lookup)}{where(lookup)} is computed by {op_name(weight)}, not "
        "read from a parameter or buffer (max_norm and weights transformed inside forward are "
        "not supported): the embedding server serves stored tables"
    )


def _trace_ids(node: fx.Node, lookup: fx.Node, user_inputs: set[str], what: str):
    """Walks from a lookup's ids back to a model input through the engine's id transforms.
    Returns (input placeholder, transform steps in order, flattened from 2-D?)."""
    steps: list[dict] = []
    flattened = False
    while node.op == "call_function":
        target = node.target
        if target in _REMAINDER and what == "ids":
            divisor = node.args[1]
            if not isinstance(divisor, int) or divisor <= 0:
                raise UnsupportedModelError(
                    f"ids of {op_name(lookup)}{where(lookup)} are hashed by {op_name(node)} with "
                    f"divisor {divisor!r}; the sparse engine supports a positive integer constant"
                )
            steps.append({"op": _REMAINDER[target], "divisor": divisor})
        elif target in _CASTS:
            dtype = node.args[1] if target is aten.to.dtype else node.kwargs.get("dtype")
            if dtype is not None:
                steps.append({"op": "cast", "dtype": str(dtype).removeprefix("torch.")})
        elif target in _FLATTEN and what == "ids" and not flattened:
            flattened = True
        elif target not in _PASSTHROUGH:
            raise UnsupportedModelError(
                f"the {what} of {op_name(lookup)}{where(lookup)} are computed by "
                f"{op_name(node)}{where(node)}, an operator the sparse engine cannot run "
                "(it runs modulo hashing, fmod by a constant and dtype casts on ids, and reads "
                "offsets and per-sample weights as given)"
            )
        node = node.all_input_nodes[0]
    if node.op != "placeholder" or node.name not in user_inputs:
        raise UnsupportedModelError(
            f"the {what} of {op_name(lookup)}{where(lookup)} come from {node.name!r}, not from "
            "a model input"
        )
    return node, steps[::-1], flattened


def _bag_lookup(node: fx.Node, params: set[str], user_inputs: set[str], kjts: KjtFields) -> Lookup:
    names = ["weight", "indices", "offsets", "scale_grad_by_freq", "mode", "sparse"]
    names += ["per_sample_weights", "include_last_offset", "padding_idx"]
    defaults = [None, None, None, False, 0, False, None, False, None]
    a = dict(zip(names, defaults, strict=True))
    a.update(zip(names, node.args, strict=False))
    a.update(node.kwargs)
    if a["padding_idx"] not in (None, -1):
        raise UnsupportedModelError(
            f"{op_name(node)}{where(node)} uses padding_idx={a['padding_idx']}; the sparse "
            "engine pools every id (remove padding_idx or filter ids before the lookup)"
        )
    for user in node.users:
        if user.target is not operator.getitem or (user.args[1] != 0 and user.users):
            raise UnsupportedModelError(
                f"{op_name(node)}{where(node)}: only the pooled result may be used, not the "
                "auxiliary outputs (offset2bag, bag sizes, max indices)"
            )
    output = next((u for u in node.users if u.args[1] == 0), node)
    table = _table(a["weight"], params, node)
    pooling = _BAG_MODES[a["mode"]]
    bag = kjt_bag(node, a, kjts) if kjts else None
    if bag is not None:
        return Lookup(output, table, bag.values, "kjt", pooling, weights=bag.weights, kjt=bag.key)
    ids, transform, flattened = _trace_ids(a["indices"], node, user_inputs, "ids")
    weights = None
    if a["per_sample_weights"] is not None:
        weights, _, _ = _trace_ids(a["per_sample_weights"], node, user_inputs, "weights")
    if flattened:  # F.embedding_bag on 2-D ids: each row is one bag
        if a["offsets"] is None or a["offsets"].target is not aten.arange.start_step:
            raise UnsupportedModelError(
                f"{op_name(node)}{where(node)}: reshaped ids need offsets of fixed-size bags"
            )
        return Lookup(output, table, ids, "fixed", pooling, transform, weights=weights)
    offsets, _, _ = _trace_ids(a["offsets"], node, user_inputs, "offsets")
    return Lookup(
        output,
        table,
        ids,
        "offsets",
        pooling,
        transform,
        offsets=offsets,
        weights=weights,
        include_last_offset=bool(a["include_last_offset"]),
    )


def _pooling_of(user: fx.Node, ids_ndim: int) -> tuple[str, fx.Node] | None:
    """If `user` pools an embedding's rows over the bag dimension: (mode, node that yields the
    pooled value)."""
    if user.target not in _POOLINGS or ids_ndim != 2:
        return None
    dims = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim")
    keepdim = user.args[2] if len(user.args) > 2 else user.kwargs.get("keepdim", False)
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    if keepdim or len(dims) != 1 or dims[0] % 3 != 1 or user.kwargs.get("dtype") is not None:
        return None
    if user.target is aten.max.dim:  # values and indices; only the values may be used
        getitems = list(user.users)
        if not all(g.target is operator.getitem for g in getitems):
            return None
        if any(g.args[1] != 0 and g.users for g in getitems):
            return None
        values = [g for g in getitems if g.args[1] == 0]
        return ("max", values[0]) if values else None
    return _POOLINGS[user.target], user


def _embedding_lookups(node: fx.Node, params: set[str], user_inputs: set[str]) -> list[Lookup]:
    table = _table(node.args[0], params, node)
    ids, transform, flattened = _trace_ids(node.args[1], node, user_inputs, "ids")
    if flattened:
        ids_ndim = len(node.args[1].meta["val"].shape)
    else:
        ids_ndim = len(ids.meta["val"].shape)
    poolings = [_pooling_of(u, ids_ndim) for u in node.users]
    # Size-aware transfer: the rows cross instead of their poolings when the poolings together
    # are at least as large, or when anything else also reads the rows.
    if poolings and all(poolings) and not flattened:
        bag_len = size_hint(node.meta["val"].shape[1])
        if len(poolings) < bag_len:
            return [Lookup(out, table, ids, "fixed", mode, transform) for mode, out in poolings]
    return [Lookup(node, table, ids, "gather", "none", transform)]


def _reject_lookups_under_control_flow(ep: torch.export.ExportedProgram) -> None:
    for node in ep.graph.nodes:
        if node.op != "call_function" or not isinstance(
            node.target, torch._ops.HigherOrderOperator
        ):
            continue
        for arg in node.all_input_nodes:
            if arg.op != "get_attr":
                continue
            sub = getattr(ep.graph_module, arg.target)
            if isinstance(sub, fx.GraphModule) and any(
                n.target in EMBEDDING_BAG_OPS | EMBEDDING_OPS for n in sub.graph.nodes
            ):
                raise UnsupportedModelError(
                    f"an embedding lookup sits under data-dependent control flow "
                    f"({node.target.__name__}{where(node)}): which rows are read must not depend "
                    "on tensor values; move the lookup out of the branch"
                )


# -- constant folding ------------------------------------------------------------------------
def _fold_constants(ep: torch.export.ExportedProgram, needed: set[fx.Node]):
    """Values of the needed nodes that depend on no model input and no parameter, computed
    once. Only the roots of constant subgraphs are kept (their users read them)."""
    constant: dict[fx.Node, object] = {}
    state = {**ep.state_dict, **ep.constants}
    sig = ep.graph_signature
    sources = {**sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            if node.name in sources:
                constant[node] = state[sources[node.name]]
            continue
        if node.op != "call_function" or node not in needed:
            continue
        if any(s in op_name(node) for s in _NOT_FOLDABLE):
            continue
        if all(a in constant for a in node.all_input_nodes):
            args = fx.node.map_arg(node.args, lambda a: constant[a])
            kwargs = fx.node.map_arg(node.kwargs, lambda a: constant[a])
            value = node.target(*args, **kwargs)
            if isinstance(value, torch.Tensor):
                constant[node] = value
    return {
        n: v
        for n, v in constant.items()
        if n.op == "call_function" and any(u not in constant for u in n.users)
    }
