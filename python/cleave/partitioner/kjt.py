"""Recognising a KeyedJaggedTensor key at the seam: which KJT and key a lookup reads.

torch.export flattens a KJT argument into `values`, `weights` and `lengths` placeholders, and
TorchRec's per-key view of it into plain ATen:

    sizes[j] = item(unbind(sum(view(lengths, [F, B]), [1]))[j])      # ids of key j
    ids      = split_with_sizes(values, sizes)[k]                     # (weights alike)
    offsets  = unbind(cat([zeros(F, 1), cumsum(view(lengths, [F, B]), -1)], -1))[k]
    embedding_bag(table, ids, offsets, ..., include_last_offset=True)

A lookup whose ids, offsets and weights are key k's segments in exactly this form is key k of
the KJT, and the router cuts those segments natively. Anything else between the KJT and the
lookup (a hash of the ids, a variable batch per key) is refused, naming the operator and line.

TorchRec's EmbeddingCollection (unpooled) reads key k row by row, `embedding(table, ids)`: its
rows [N_k, D] cross the seam as they are, and the dense program takes the KJT's lengths to
find each sample's rows (docs/partitioning.md, "TorchRec models").
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from cleave.errors import UnsupportedModelError
from cleave.partitioner import fbgemm
from cleave.partitioner.capture import KjtInput
from cleave.partitioner.nodes import op_name, where

aten = torch.ops.aten
_QUIET = {  # steps that leave every element as it is
    aten.alias.default,
    aten.clone.default,
    aten.contiguous.default,
    aten._to_copy.default,
    aten.to.dtype,
    aten.to.dtype_layout,
}

# placeholder name -> (its KJT argument, field: "values", "weights" or "lengths")
KjtFields = dict[str, tuple[KjtInput, str]]


@dataclass(frozen=True)
class KjtKey:
    """Key `index` of the KJT argument `kjt`."""

    kjt: KjtInput
    index: int
    lengths: fx.Node

    @property
    def name(self) -> str:
        return self.kjt.keys[self.index]


@dataclass(frozen=True)
class KjtBag:
    values: fx.Node
    weights: fx.Node | None
    key: KjtKey


def kjt_fields(ep: torch.export.ExportedProgram, names: list[str], kjts: list[KjtInput]):
    """The KJT placeholders of `ep`, given the flat input names (capture.input_names)."""
    by_input = {k.input(f): (k, f) for k in kjts for f in k.fields}
    users = [n for n in ep.graph_signature.user_inputs if n is not None]
    return {ph: by_input[name] for name, ph in zip(names, users, strict=True) if name in by_input}


def kjt_bag(lookup: fx.Node, args: dict, kjts: KjtFields) -> KjtBag | None:
    """Key k's bag if `lookup`'s ids are key k's segment of a KJT's values; None when its ids
    do not come from a KJT at all. Raises when they do, but not in the form above."""
    ids = _quiet(args["indices"])
    values, index = _segment(ids, kjts, "values", lookup)
    if values is None:
        if reads_kjt(args["indices"], kjts):
            _refuse(lookup, ids, "ids")
        return None
    kjt, _ = kjts[values.name]
    key = KjtKey(kjt, index, _lengths_of(values, kjt, kjts))
    offsets = _offsets_key(_quiet(args["offsets"]), kjts)
    if offsets != (key.lengths, index) or not args["include_last_offset"]:
        _refuse(lookup, _quiet(args["offsets"]), "offsets")
    weights = None
    if args["per_sample_weights"] is not None:
        w = _quiet(args["per_sample_weights"])
        weights, w_index = _segment(w, kjts, "weights", lookup)
        if weights is None or w_index != index or kjts[weights.name][0] != kjt:
            _refuse(lookup, w, "per-sample weights")
    return KjtBag(values, weights, key)


def kjt_rows(lookup: fx.Node, kjts: KjtFields) -> tuple[fx.Node, KjtKey] | None:
    """(the values placeholder, key k) if `lookup` (aten.embedding) reads key k's segment of a
    KJT's values row by row; None when its ids do not come from a KJT at all. Raises when they
    do, but not as TorchRec's per-key split."""
    ids = _quiet(lookup.args[1])
    values, index = _segment(ids, kjts, "values", lookup)
    if values is None:
        if reads_kjt(lookup.args[1], kjts):
            _refuse(lookup, ids, "ids")
        return None
    kjt, _ = kjts[values.name]
    return values, KjtKey(kjt, index, _lengths_of(values, kjt, kjts))


def key_size(node: fx.Node, kjts: KjtFields) -> tuple[KjtInput, int] | None:
    """(the KJT, j) if `node` is key j's number of ids, item(sum(view(lengths, [F, B]))[j])."""
    if node.op != "call_function" or node.target is not aten.item.default:
        return None
    found = _key_sum(node, None)
    if found is None or found[0] not in kjts:
        return None
    return kjts[found[0]][0], found[1]


def _quiet(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in _QUIET:
        node = node.all_input_nodes[0]
    return node


def _segment(node: fx.Node, kjts: KjtFields, field: str, lookup: fx.Node):
    """(the KJT's `field` placeholder, k) if `node` is `split_with_sizes(field, sizes)[k]`."""
    if node.target is not operator.getitem:
        return None, None
    split = node.args[0]
    if split.op != "call_function" or split.target is not aten.split_with_sizes.default:
        return None, None
    source = _quiet(split.args[0])
    if source.op != "placeholder" or source.name not in kjts:
        if reads_kjt(source, kjts):
            _refuse(lookup, source, field)
        return None, None
    kjt, got = kjts[source.name]
    sizes = split.args[1]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if got != field or len(sizes) != len(kjt.keys) or dim != 0:
        _refuse(lookup, split, field)
    lengths = _lengths_placeholder(kjt, kjts)
    for j, size in enumerate(sizes):
        if _key_sum(size, kjt) != (lengths, j):
            _refuse(lookup, size if isinstance(size, fx.Node) else split, field)
    return source, node.args[1]


def _lengths_placeholder(kjt: KjtInput, kjts: KjtFields) -> fx.Node | None:
    return next((ph for ph, (k, f) in kjts.items() if k == kjt and f == "lengths"), None)


def _lengths_of(values: fx.Node, kjt: KjtInput, kjts: KjtFields) -> fx.Node:
    name = _lengths_placeholder(kjt, kjts)
    return next(n for n in values.graph.nodes if n.op == "placeholder" and n.name == name)


def _by_key(node: fx.Node, kjt: KjtInput | None = None):
    """The lengths placeholder if `node` is `view(lengths, [F, B])`."""
    node = _quiet(node)
    if node.target not in (aten.view.default, aten.reshape.default):
        return None
    source = _quiet(node.args[0])
    shape = node.args[1]
    if source.op != "placeholder" or len(shape) != 2:
        return None
    if kjt is not None and shape[0] != len(kjt.keys):
        return None
    return source.name


def _key_sum(size, kjt: KjtInput | None):
    """(lengths placeholder, j) if `size` is item(unbind(sum(view(lengths, [F, B]), [1]))[j])."""
    if not isinstance(size, fx.Node) or size.target is not aten.item.default:
        return None
    pick = _quiet(size.args[0])
    if pick.target is not operator.getitem or pick.args[0].target is not aten.unbind.int:
        return None
    total = pick.args[0].args[0]
    if total.target is not aten.sum.dim_IntList or list(total.args[1]) not in ([1], [-1]):
        return None
    return _by_key(total.args[0], kjt), pick.args[1]


def _offsets_key(node: fx.Node, kjts: KjtFields):
    """(lengths placeholder name, k) if `node` is key k's offsets: unbind(cat([zeros,
    cumsum(view(lengths, [F, B]), -1)], -1))[k]."""
    if node.target is not operator.getitem or node.args[0].target is not aten.unbind.int:
        return None
    joined = node.args[0].args[0]
    if joined.target is not aten.cat.default or len(joined.args[0]) != 2:
        return None
    zeros, sums = joined.args[0][0], _quiet(joined.args[0][1])
    if zeros.target not in (aten.new_zeros.default, aten.zeros.default):
        return None
    if sums.target is not aten.cumsum.default or sums.args[1] not in (1, -1):
        return None
    lengths = _by_key(sums.args[0])
    if lengths not in kjts or kjts[lengths][1] != "lengths":
        return None
    placeholder = next(n for n in node.graph.nodes if n.name == lengths)
    return placeholder, node.args[1]


def reads_kjt(node: fx.Node, kjts: KjtFields) -> bool:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and n.name in kjts:
            return True
        stack.extend(n.all_input_nodes)
    return False


def refuse_fbgemm(dense_nodes: list[fx.Node], unpooled: list[fx.Node]) -> None:
    """Raises naming the first fbgemm operator of the dense side that Cleave cannot replace by
    ATen (fbgemm.py), and the unpooled lookup whose rows reach it, if any."""
    for node in dense_nodes:
        if not fbgemm.is_fbgemm(node) or fbgemm.decomposition(node) is not None:
            continue
        lookup = next((lk for lk in unpooled if _reaches(lk, node)), None)
        op = f"{op_name(node)}{where(node)}, an fbgemm operator, which the served side does not run"
        if lookup is None:
            raise UnsupportedModelError(
                f"the dense side calls {op}; Cleave serves dense programs of ATen operators"
            )
        raise UnsupportedModelError(
            f"{op_name(lookup)}{where(lookup)} reads a KeyedJaggedTensor key row by row "
            f"(TorchRec's EmbeddingCollection, unpooled); its rows reach the dense side through "
            f"{op}. Cleave replaces fbgemm.jagged_to_padded_dense (JaggedTensor.to_padded_dense) "
            "by ATen operators; reduce the rows with torch operators on values() and lengths()"
        )


def _reaches(source: fx.Node, target: fx.Node) -> bool:
    stack, seen = [target], set()
    while stack:
        n = stack.pop()
        if n is source:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return False


def _refuse(lookup: fx.Node, node: fx.Node, what: str):
    """The first operator on the way back from `node` to the KJT that is not TorchRec's own
    per-key split (module docstring) is the one named."""
    culprit = _first_foreign(node)
    raise UnsupportedModelError(
        f"the {what} of {op_name(lookup)}{where(lookup)} are computed from a "
        f"KeyedJaggedTensor by {op_name(culprit)}{where(culprit)}; Cleave serves a KJT key's "
        "values, lengths and weights as they are (TorchRec's EmbeddingBagCollection over "
        "the KJT). Transform ids before building the KJT, not between it and the lookup"
    )


_SPLIT_OPS = _QUIET | {
    operator.getitem,
    aten.split_with_sizes.default,
    aten.unbind.int,
    aten.item.default,
    aten.sum.dim_IntList,
    aten.view.default,
    aten.cat.default,
    aten.cumsum.default,
    aten.new_zeros.default,
}


def _first_foreign(node: fx.Node) -> fx.Node:
    """The node nearest `node` (inclusive) whose operator is not part of the per-key split."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop(0)
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if n.target not in _SPLIT_OPS:
            return n
        stack.extend(n.all_input_nodes)
    return node
