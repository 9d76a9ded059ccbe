"""Capturing a model's graph with torch.export, with every size free to vary.

Every dimension of every input is marked `Dim.AUTO`: export keeps it symbolic unless the model
pins it (a weight's width, a static loop count), so a bundle serves any batch size and any bag
length, not only the example's. Export's own errors become Cleave errors in the user's terms.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import logging
import re

import torch
import torch.utils._pytree as pytree
from torch.export import Dim

from cleave.errors import UnsupportedModelError

_DATA_DEPENDENT = re.compile(
    r"data.dependent|GuardOnDataDependentSymNode|Could not guard on data-dependent", re.I
)


def dynamic_shapes(args: tuple):
    """A dynamic_shapes spec for export: every dim of every tensor leaf is Dim.AUTO."""

    def spec(x):
        if isinstance(x, torch.Tensor):
            return {i: Dim.AUTO for i in range(x.dim())}
        return None

    return pytree.tree_map(spec, args)


def check_inputs(args) -> tuple:
    if not isinstance(args, tuple):
        raise UnsupportedModelError(
            "example_inputs must be a tuple of the forward's positional arguments, "
            f"got {type(args).__name__}"
        )
    for leaf in pytree.tree_leaves(args):
        if not isinstance(leaf, torch.Tensor):
            raise UnsupportedModelError(
                "forward arguments must be tensors or lists/tuples of tensors; "
                f"got a {type(leaf).__name__} ({leaf!r})"
            )
    return args


def input_names(model: torch.nn.Module, args: tuple) -> list[str]:
    """Names of the flat input tensors: the forward's parameter names, with `_0`, `_1`, ...
    appended for the elements of a list or tuple argument."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for i, arg in enumerate(args):
        base = params[i].name if i < len(params) else f"arg{i}"
        if params and i < len(params) and params[i].kind is inspect.Parameter.VAR_POSITIONAL:
            base = f"{params[i].name}_{i - len(params) + 1}"
        names += _leaf_names(base, arg)
    return names


def _leaf_names(base: str, arg) -> list[str]:
    if isinstance(arg, (list, tuple)):
        return [n for j, x in enumerate(arg) for n in _leaf_names(f"{base}_{j}", x)]
    return [base]


def capture(model: torch.nn.Module, args: tuple) -> torch.export.ExportedProgram:
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModelError(f"expected a torch.nn.Module, got {type(model).__name__}")
    args = check_inputs(args)
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
