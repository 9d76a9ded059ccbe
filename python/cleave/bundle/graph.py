"""The dense program's graph in a plain stored form (docs/bundle.md, "dense"), written beside
the torch.export archive so that a ranker starts without `torch.export.load`.

`ExportedProgram.module()` is an FX GraphModule: aten operators in graph order, the weights
as attributes, a `_guards_fn` that checks the inputs' sizes, and pytree code around them. Reading
it back through `torch.export.load` imports export's serializer, sympy, TorchDynamo and parts
of Inductor and rebuilds symbolic shapes the ranker never uses: about 2 s of CPU per ranker
start. This file keeps that GraphModule itself: its nodes (operator names and arguments), its
weights and its guards as data (`torch.save`, read back with `weights_only`), and rebuilds it
with `torch.fx` alone. `encode` refuses what it cannot store exactly (a node it does not know,
a guard that needs sympy); the bundle is then written without the graph, and rankers read the
archive as before. `Bundle.save` checks every graph it writes: the rebuilt module's code is
the original's and its outputs on the probe batch are bit for bit the same.
"""

from __future__ import annotations

import io
import math
import operator
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch import fx

from cleave.errors import BundleError

__all__ = ["GraphUnsupported", "stored", "encode", "decode", "guards_of", "same_code", "load"]

FORMAT = "cleave-dense-graph"
VERSION = 1
GUARDS = "_guards_fn"  # the submodule `ExportedProgram.module()` calls on the inputs first

# Plain functions a graph may call besides operators (`torch.ops.NS.NAME.OVERLOAD`): by module,
# so that a stored name resolves only to one of these, never to arbitrary code.
_FUNCTION_MODULES = {"operator": operator, "_operator": operator, "math": math, "torch": torch}
_GUARD_NAMES = {"args", "math", "torch"}  # what a stored guard expression may name


class GraphUnsupported(Exception):
    """The program has something this form does not store; the bundle keeps the archive only."""


# -- writing ---------------------------------------------------------------------------------
def stored(program: torch.export.ExportedProgram, probe_inputs=None) -> bytes:
    """The stored form of `program.module()` (the file's bytes), checked: read back as a
    ranker reads it, the module generates the same code and (given the probe batch's inputs)
    the same outputs, bit for bit."""
    module, guards = guards_of(program)
    file = io.BytesIO()
    torch.save(encode(module, guards), file)
    try:
        rebuilt = decode(torch.load(io.BytesIO(file.getvalue()), weights_only=True))
    except Exception as err:  # anything: the bundle is then written without the graph
        raise GraphUnsupported(f"it does not read back: {err!r}") from None
    if not same_code(module, rebuilt):
        raise GraphUnsupported("read back, it generates different code")
    if probe_inputs is not None:
        with torch.inference_mode():
            want = pytree.tree_leaves(module(*probe_inputs))
            got = pytree.tree_leaves(rebuilt(*probe_inputs))
        if len(got) != len(want) or not all(map(torch.equal, got, want)):
            raise GraphUnsupported("read back, its outputs on the probe batch differ")
    return file.getvalue()


def guards_of(program: torch.export.ExportedProgram) -> tuple[torch.nn.Module, list]:
    """`program.module()`, and its `_guards_fn`'s checks: [expression over `args` (the flat
    inputs), the same over the inputs' names (for the message)]. PyTorch builds `_guards_fn`
    from such expressions and keeps only the compiled function, so they are read as it builds
    them (its private helper `torch.export._unlift._convert_guards_code_to_fn`, with the same
    replacement of input paths by `args[i]`); if that helper moves, the bundle is written
    without the graph (tests/test_dense_graph.py notices)."""
    from torch.export import _unlift

    helper = getattr(_unlift, "_convert_guards_code_to_fn", None)
    if helper is None:
        raise GraphUnsupported("this PyTorch builds input guards differently")
    seen: list[list[str]] = []

    def capture(guards_code, paths):
        checks = []
        for code in guards_code:
            check, shown = code, code  # over the flat inputs; over the inputs' names
            for index, path in enumerate(paths):
                check = check.replace("L" + pytree.keystr(path), f"args[{index}]")
                shown = shown.replace("L" + pytree.keystr(path), _path_name(path))
            checks.append([check, shown])
        seen.append(checks)
        return helper(guards_code, paths)

    _unlift._convert_guards_code_to_fn = capture
    try:
        module = program.module()
    finally:
        _unlift._convert_guards_code_to_fn = helper
    has_guards = hasattr(module, GUARDS)
    if len(seen) != int(has_guards):
        raise GraphUnsupported(f"expected {int(has_guards)} guard functions, saw {len(seen)}")
    return module, seen[0] if seen else []


def _path_name(path) -> str:
    first = path[0]
    return str(getattr(first, "key", getattr(first, "idx", first))) + pytree.keystr(path[1:])


def encode(module: fx.GraphModule, guards: list) -> dict:
    """The stored form of `module` (from `ExportedProgram.module()`, whose `_guards_fn` checks
    `guards`): plain data and tensors for `torch.save`."""
    codegen = module.graph._codegen
    if not isinstance(codegen, fx.graph._PyTreeCodeGen):
        raise GraphUnsupported(f"unexpected code generator {type(codegen).__name__}")
    for check, _ in guards:
        _compile_guard(check)  # refuses one that needs more than args, math and torch
    nodes, attributes = [], {}
    for node in module.graph.nodes:
        if node.op == "call_module" and node.target != GUARDS:
            raise GraphUnsupported(f"node {node.name} calls module {node.target!r}")
        if node.op == "get_attr":
            attributes[node.target] = _attribute(module, node.target)
        target = _function_name(node.target) if node.op == "call_function" else node.target
        nodes.append(
            {
                "op": node.op,
                "name": node.name,
                "target": target,
                "args": _value(node.args),
                "kwargs": _value(node.kwargs),
            }
        )
    info = codegen.pytree_info
    return {
        "format": FORMAT,
        "version": VERSION,
        "torch": str(torch.__version__),
        "nodes": nodes,
        "orig_args": list(info.orig_args),
        "in_spec": pytree.treespec_dumps(info.in_spec),
        "out_spec": pytree.treespec_dumps(info.out_spec),
        "guards": [list(g) for g in guards],
        "attributes": attributes,
    }


def _function_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target._schema.name.split("::")
        return f"torch.ops.{ns}.{name}.{target._overloadname}"
    module = getattr(target, "__module__", None)
    name = getattr(target, "__name__", None)
    if (
        module in _FUNCTION_MODULES
        and _callable(module.lstrip("_"), name)
        and getattr(_FUNCTION_MODULES[module], name, None) is target
    ):
        return f"{module.lstrip('_')}.{name}"
    raise GraphUnsupported(f"cannot store a call of {target!r}")


def _attribute(module: torch.nn.Module, target: str) -> dict:
    """A weight by its dotted name: parameter, buffer or plain tensor attribute."""
    *path, field = target.split(".")
    owner = module.get_submodule(".".join(path)) if path else module
    value = getattr(owner, field)
    if not isinstance(value, torch.Tensor):
        raise GraphUnsupported(f"attribute {target} is a {type(value).__name__}, not a tensor")
    if field in owner._parameters:
        kind, extra = "parameter", value.requires_grad
    elif field in owner._buffers:
        kind, extra = "buffer", field not in owner._non_persistent_buffers_set
    else:
        kind, extra = "constant", None
    return {"kind": kind, "tensor": value.detach(), "extra": extra}


def _value(value):
    """A node's argument as plain data: nodes by name, torch enums by name, tagged containers."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if isinstance(value, (list, tuple)):
        tag = "tuple" if isinstance(value, tuple) else "list"
        return {tag: [_value(v) for v in value]}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise GraphUnsupported(f"a dict argument with keys {list(value)}")
        return {"dict": {k: _value(v) for k, v in value.items()}}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    raise GraphUnsupported(f"cannot store an argument of type {type(value).__name__}")


def same_code(a: fx.GraphModule, b: fx.GraphModule) -> bool:
    """Whether two GraphModules generate the same Python, comments (source lines) aside."""

    def lines(module):
        return [s for s in (line.strip() for line in module.code.splitlines()) if s and s[0] != "#"]

    return lines(a) == lines(b)


# -- reading ---------------------------------------------------------------------------------
def load(file: Path) -> fx.GraphModule:
    """The GraphModule stored in `file`; a BundleError naming the file if it cannot be read."""
    try:
        data = torch.load(file, weights_only=True)
    except FileNotFoundError:
        raise BundleError(f"{file}: the dense graph is missing") from None
    except Exception as err:
        raise BundleError(f"{file}: cannot read the dense graph: {err}") from None
    try:
        return decode(data)
    except (
        KeyError, TypeError, ValueError, AttributeError, SyntaxError, RuntimeError,
        GraphUnsupported,
    ) as err:  # fmt: skip
        raise BundleError(f"{file}: not a dense graph this cleave reads: {err!r}") from None


def decode(data: dict) -> fx.GraphModule:
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise ValueError(f"format {data.get('format')!r} version {data.get('version')!r}")
    root = torch.nn.Module()
    constants = []
    for target, attribute in data["attributes"].items():
        *path, field = target.split(".")
        owner = root
        for name in path:
            if not hasattr(owner, name):
                owner.add_module(name, torch.nn.Module())
            owner = getattr(owner, name)
        tensor, extra = attribute["tensor"], attribute["extra"]
        if attribute["kind"] == "parameter":
            owner.register_parameter(field, torch.nn.Parameter(tensor, requires_grad=extra))
        elif attribute["kind"] == "buffer":
            owner.register_buffer(field, tensor, persistent=extra)
        else:
            constants.append((target, tensor))
            owner.register_buffer(field, tensor)  # made a plain attribute again below
    if data["guards"]:
        root.add_module(GUARDS, _Guards(data["guards"]))

    graph = fx.Graph()
    made: dict[str, fx.Node] = {}
    for spec in data["nodes"]:
        target = spec["target"]
        if spec["op"] == "call_function":
            target = _resolve(target)
        node = graph.create_node(
            spec["op"],
            target,
            _node_value(spec["args"], made),
            _node_value(spec["kwargs"], made),
            name=spec["name"],
        )
        if node.name != spec["name"]:
            raise ValueError(f"node {spec['name']!r} came back as {node.name!r}")
        made[node.name] = node
    graph._codegen = fx.graph._PyTreeCodeGen(
        fx.graph._PyTreeInfo(
            data["orig_args"],
            pytree.treespec_loads(data["in_spec"]),
            pytree.treespec_loads(data["out_spec"]),
        )
    )
    module = fx.GraphModule(root, graph)
    # GraphModule registers every tensor it copies as a buffer; a constant of the original
    # module is a plain attribute (not moved by `.to(device)`, not in its state_dict).
    for target, tensor in constants:
        *path, field = target.split(".")
        owner = module.get_submodule(".".join(path)) if path else module
        del owner._buffers[field]
        setattr(owner, field, tensor)
    return module


def _resolve(name: str):
    parts = name.split(".")
    if parts[:2] == ["torch", "ops"] and len(parts) == 5:
        packet = getattr(getattr(torch.ops, parts[2]), parts[3])
        return getattr(packet, parts[4])
    module, function = name.rsplit(".", 1)
    if module not in _FUNCTION_MODULES or not _callable(module, function):
        raise ValueError(f"unknown function {name!r}")
    return getattr(_FUNCTION_MODULES[module], function)


def _callable(module: str, function: str) -> bool:
    """Whether a graph may call `module.function` besides operators: operator's and math's
    functions, torch's `sym_` ones (torch's others, `torch.save` say, are never stored)."""
    if function.startswith("_"):
        return False
    return module != "torch" or function.startswith("sym_")


_TORCH_ENUMS = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}


def _node_value(value, made: dict[str, fx.Node]):
    if not isinstance(value, dict):
        return value
    (tag, inner), *rest = value.items()
    if rest:
        raise ValueError(f"unexpected argument {value!r}")
    if tag == "node":
        return made[inner]
    if tag in ("list", "tuple"):
        items = [_node_value(v, made) for v in inner]
        return tuple(items) if tag == "tuple" else items
    if tag == "dict":
        return {k: _node_value(v, made) for k, v in inner.items()}
    if tag == "device":
        return torch.device(inner)
    found = getattr(torch, inner, None)
    if tag not in _TORCH_ENUMS or not isinstance(found, _TORCH_ENUMS[tag]):
        raise ValueError(f"unexpected argument {value!r}")
    return found


def _compile_guard(check: str):
    import ast

    try:
        tree = ast.parse(check, mode="eval")
    except SyntaxError as err:
        raise GraphUnsupported(f"guard {check!r} is not a Python expression: {err}") from None
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    if not names <= _GUARD_NAMES:
        raise GraphUnsupported(f"guard {check!r} names {sorted(names - _GUARD_NAMES)}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not _safe_attribute(node):
            raise GraphUnsupported(f"guard {check!r} reads .{node.attr}")
    return compile(tree, "<dense graph guard>", "eval")


# What a guard may read of an input (PyTorch's guards compare sizes): with only these, and
# math's and torch's `sym_` functions, a stored guard cannot run other code when a bundle
# is read.
_SAFE_ATTRIBUTES = {"size", "dim", "shape", "numel", "stride", "dtype", "device"}


def _safe_attribute(node) -> bool:
    import ast

    owner = node.value.id if isinstance(node.value, ast.Name) else None
    if owner == "math":
        return not node.attr.startswith("_")
    if owner == "torch":
        return node.attr.startswith("sym_")
    return node.attr in _SAFE_ATTRIBUTES


class _Guards(torch.nn.Module):
    """The `_guards_fn` of `ExportedProgram.module()`: each check on the flat inputs, failing
    with an AssertionError that names it, as PyTorch's does."""

    _is_impure = True  # called for its checks only: dead-code elimination must keep it

    def __init__(self, guards: list):
        super().__init__()
        self.guards = [(check, shown, _compile_guard(check)) for check, shown in guards]

    def forward(self, *args):
        scope = {"args": args, "math": math, "torch": torch}
        for _, shown, code in self.guards:
            torch._assert(eval(code, scope), f"Guard failed: {shown}")
