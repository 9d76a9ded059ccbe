"""How the partitioner names graph nodes in its messages: the operator and the user's line."""

from __future__ import annotations

from torch import fx


def op_name(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", str(target))
    schema = getattr(target, "_schema", None)
    # "aten::embedding" -> aten.embedding; other namespaces (fbgemm::...) keep theirs.
    return schema.name.replace("::", ".") if schema is not None else name


def where(node: fx.Node) -> str:
    """The user's source line that produced a node, when export recorded it."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File")]
    lines = [ln for ln in lines if "/torch/" not in ln and '"<' not in ln]
    return f" ({lines[-1]})" if lines else ""
