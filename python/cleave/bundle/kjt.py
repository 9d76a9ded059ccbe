"""TorchRec's KeyedJaggedTensor (KJT) as a model argument: the flat tensors it is served as.

A KJT argument `p` is served as the inputs `p.values`, `p.lengths` and, when it carries
per-sample weights, `p.weights` (docs/api.md, "KeyedJaggedTensor inputs"). A KJT built from
offsets is the same KJT: it is rebuilt from its lengths, so a bundle has one form to serve.
TorchRec is never imported here: a KJT is recognised by its class, which only a caller that
already imported TorchRec can hold, so the serving side needs no TorchRec.
"""

from __future__ import annotations

import sys

import torch
import torch.utils._pytree as pytree

from cleave.errors import UnsupportedModelError

# The KJT's tensors in the order TorchRec's pytree flattening yields them; a missing one
# (no weights) is left out.
FIELDS = ("values", "weights", "lengths")


def kjt_class():
    module = sys.modules.get("torchrec.sparse.jagged_tensor")
    return getattr(module, "KeyedJaggedTensor", None)


def is_kjt(x) -> bool:
    cls = kjt_class()
    return cls is not None and isinstance(x, cls)


def fields(kjt) -> dict[str, torch.Tensor]:
    """The KJT's tensors by field name, lengths computed from offsets where needed."""
    if kjt.variable_stride_per_key():
        raise UnsupportedModelError(
            "a variable-batch KeyedJaggedTensor (stride_per_key_per_rank: a batch size per key) "
            "is not supported; give every key the same batch size"
        )
    if kjt.inverse_indices_or_none() is not None:
        raise UnsupportedModelError(
            "a KeyedJaggedTensor with inverse_indices (deduplicated variable-batch features) is "
            "not supported; send one bag per key and sample"
        )
    out = {"values": kjt.values(), "weights": kjt.weights_or_none(), "lengths": kjt.lengths()}
    return {k: v for k, v in out.items() if v is not None}


def normalize(args):
    """`args` with each KJT rebuilt from values, lengths and weights only (export then sees
    exactly the tensors a request carries, and no cached offsets)."""
    cls = kjt_class()
    if cls is None:
        return args

    def rebuild(x):
        if not isinstance(x, cls):
            return x
        f = fields(x)
        return cls(
            keys=x.keys(), values=f["values"], weights=f.get("weights"), lengths=f["lengths"]
        )

    return pytree.tree_map(rebuild, args, is_leaf=lambda x: isinstance(x, cls))


def flat_tensors(args) -> list[torch.Tensor]:
    """The forward arguments' tensors in manifest input order: a KJT's values, weights (if
    any) and lengths where it stands."""
    out = []
    for leaf in pytree.tree_leaves(args, is_leaf=is_kjt):
        if is_kjt(leaf):
            out.extend(fields(leaf).values())
        elif isinstance(leaf, torch.Tensor):
            out.append(leaf)
    return out


def named_inputs(names: list[str], args) -> dict[str, torch.Tensor]:
    """The forward arguments as tensors by manifest input name (`names`, in manifest order)."""
    from cleave.errors import CleaveError

    tensors = flat_tensors(args)
    if len(tensors) != len(names):
        raise CleaveError(
            f"expected {len(names)} input tensors ({', '.join(names)}), got {len(tensors)}"
        )
    return dict(zip(names, tensors, strict=True))
