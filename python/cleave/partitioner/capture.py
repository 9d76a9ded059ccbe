"""Capturing a model's graph with torch.export, with every size free to vary.

Every dimension of every input is marked `Dim.AUTO`: export keeps it symbolic unless the model
pins it (a weight's width, a static loop count), so a bundle serves any batch size and any bag
length, not only the example's. A TorchRec KeyedJaggedTensor (KJT) is the exception: its
`lengths` hold F bags per sample, so their size is stated as F·B of a named batch B, which the
leading size of every other input of the KJT's batch size shares (export cannot infer a
product from AUTO sizes). Export's own errors become Cleave errors in the user's terms.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import linecache
import logging
import re
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.export import Dim

from cleave.bundle import kjt as kjt_io
from cleave.errors import UnsupportedModelError

_DATA_DEPENDENT = re.compile(
    r"data.dependent|GuardOnDataDependentSymNode|Could not guard on data-dependent", re.I
)


def dynamic_shapes(args: tuple):
    """A dynamic_shapes spec for export: every dim of every tensor leaf is Dim.AUTO, but for
    KJTs and the batch they share with the other inputs (module docstring)."""
    stride = _kjt_batch(args)
    batch = Dim("B") if stride is not None else None
    count = itertools.count()

    def spec(x):
        if kjt_io.is_kjt(x):
            return _kjt_spec(x, batch, f"N{next(count)}")
        if isinstance(x, torch.Tensor):
            dims = {i: Dim.AUTO for i in range(x.dim())}
            if batch is not None and x.dim() > 0 and x.shape[0] == stride:
                dims[0] = batch
            return dims
        return None

    return pytree.tree_map(spec, args, is_leaf=kjt_io.is_kjt)


def dense_shapes(args: tuple, shapes: list[list], named_batch: bool) -> tuple:
    """The spec of the dense program's inputs `args`, given their manifest shapes: every size
    AUTO, but with `named_batch` (a KJT's lengths cut by key among them, which the program
    joins into F·B) the leading "B" of every input is one named batch, so that the program
    knows F·B as F times the batch, not as a size of its own."""
    spec = dynamic_shapes(args)
    if named_batch:
        batch = Dim("B")
        for dims, shape in zip(spec, shapes, strict=True):
            if shape and shape[0] == "B":
                dims[0] = batch
    return spec


def _kjt_batch(args) -> int | None:
    kjts = [x for x in pytree.tree_leaves(args, is_leaf=kjt_io.is_kjt) if kjt_io.is_kjt(x)]
    strides = sorted({k.stride() for k in kjts})
    if len(strides) > 1:
        raise UnsupportedModelError(
            f"the example's KeyedJaggedTensors have batch sizes {strides}; they must share one"
        )
    if strides and strides[0] < 2:
        raise UnsupportedModelError(
            "the example's KeyedJaggedTensor has a batch of 1; give an example batch of at "
            "least 2 so that the bundle serves every batch size (export pins a size of 1)"
        )
    return strides[0] if strides else None


def _kjt_spec(kjt, batch: Dim, ids: str) -> list:
    """The spec of a KJT's pytree children: values and weights share a size, lengths are F·B."""
    children, _ = pytree.SUPPORTED_NODES[type(kjt)].flatten_fn(kjt)
    values, weights = kjt.values(), kjt.weights_or_none()
    n = Dim(ids)
    sizes = {id(values): n, id(kjt.lengths()): len(kjt.keys()) * batch}
    if weights is not None:
        sizes[id(weights)] = n
    return [{0: sizes[id(c)]} if isinstance(c, torch.Tensor) else None for c in children]


def check_inputs(args) -> tuple:
    if not isinstance(args, tuple):
        raise UnsupportedModelError(
            "example_inputs must be a tuple of the forward's positional arguments, "
            f"got {type(args).__name__}"
        )
    for leaf in pytree.tree_leaves(args, is_leaf=kjt_io.is_kjt):
        if not isinstance(leaf, torch.Tensor) and not kjt_io.is_kjt(leaf):
            raise UnsupportedModelError(
                "forward arguments must be tensors, TorchRec KeyedJaggedTensors or lists/tuples "
                "of tensors; "
                f"got a {type(leaf).__name__} ({leaf!r})"
            )
    return args


@dataclass(frozen=True)
class KjtInput:
    """A KeyedJaggedTensor argument: its name, keys in order, and the fields it carries."""

    name: str
    keys: tuple[str, ...]
    fields: tuple[str, ...]

    def input(self, field: str) -> str:
        return f"{self.name}.{field}"


def kjt_inputs(model: torch.nn.Module, args: tuple) -> list[KjtInput]:
    """The KJT arguments of `args`, named like their flat inputs (`p.values` -> `p`)."""
    out = []
    for i, arg in enumerate(args):
        leaves = pytree.tree_leaves(arg, is_leaf=kjt_io.is_kjt)
        kjts = [x for x in leaves if kjt_io.is_kjt(x)]
        names = [n for n in input_names_of(model, i, arg) if n.endswith(".values")]
        for kjt, name in zip(kjts, names, strict=True):
            out.append(
                KjtInput(name.removesuffix(".values"), tuple(kjt.keys()), tuple(kjt_io.fields(kjt)))
            )
    return out


def input_names(model: torch.nn.Module, args: tuple) -> list[str]:
    """Names of the flat input tensors: the forward's parameter names, with `_0`, `_1`, ...
    appended for the elements of a list or tuple argument."""
    return [n for i, arg in enumerate(args) for n in input_names_of(model, i, arg)]


def input_names_of(model: torch.nn.Module, i: int, arg) -> list[str]:
    """The flat input names of forward's `i`-th argument."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    base = params[i].name if i < len(params) else f"arg{i}"
    if params and i < len(params) and params[i].kind is inspect.Parameter.VAR_POSITIONAL:
        base = f"{params[i].name}_{i - len(params) + 1}"
    return _leaf_names(base, arg)


def _leaf_names(base: str, arg) -> list[str]:
    if kjt_io.is_kjt(arg):
        return [f"{base}.{field}" for field in kjt_io.fields(arg)]
    if isinstance(arg, (list, tuple)):
        return [n for j, x in enumerate(arg) for n in _leaf_names(f"{base}_{j}", x)]
    return [base]


def capture(model: torch.nn.Module, args: tuple) -> torch.export.ExportedProgram:
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModelError(f"expected a torch.nn.Module, got {type(model).__name__}")
    args = kjt_io.normalize(check_inputs(args))
    model.eval()
    try:
        with torch.no_grad(), _quiet_specialization():
            return torch.export.export(model, args, dynamic_shapes=dynamic_shapes(args))
    except Exception as err:  # export raises dozens of types; all become one user-facing error
        raise UnsupportedModelError(_explain(err)) from err


@contextlib.contextmanager
def _quiet_specialization():
    """Export warns when a size of 1 is pinned; for shared inputs (batch 1) that is intended."""
    logger = logging.getLogger("torch._export.non_strict_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _explain(err: Exception) -> str:
    text = str(err)
    where = _user_frame(text)
    if "ScriptObject" in text and "fbgemm" in text:
        return (
            "the model holds fbgemm kernel state (TorchScript objects), as a TorchRec model "
            "converted by torchrec.inference's quantize_inference_model does; it does not "
            "export. Partition the float model instead and quantize its tables with "
            "--table-dtype int8|int4 (partition(..., table_dtype='int8_rowwise')). "
            f"(torch.export: {_first_line(text)})"
        )
    if _DATA_DEPENDENT.search(text):
        return (
            "the model's forward branches on, or sizes a tensor by, the *values* of a tensor"
            f"{where}; Cleave needs a graph whose structure depends only on shapes. Keep Python "
            "control flow on shapes and constants, or use torch.cond outside the embedding "
            f"lookups. (torch.export: {_first_line(text)})"
        )
    return f"torch.export could not capture the model{where}: {_first_line(text)}"


def _user_frame(text: str) -> str:
    frames = re.findall(r'File "([^"<]+)", line (\d+)', text)
    frames = [f for f in frames if "/torch/" not in f[0] and "/cleave/partitioner/" not in f[0]]
    if not frames:
        return ""
    file, line = frames[-1]
    code = linecache.getline(file, int(line)).strip()
    return f" (at {file}:{line}: `{code}`)" if code else f" (at {file}:{line})"


def _first_line(text: str) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()
    return "unknown error"
