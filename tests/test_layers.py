"""Python layers run one way (docs/architecture.md): the import graph of the `cleave` package,
built statically from its sources, has no cycle among packages, nothing below the command line
imports a command-line module, and bundle metadata reads without torch.

Every import counts as an edge, at module level or inside a function: a lazy import still runs
(only later), so it is as much a dependency as one at the top of the file.

Nodes are the packages (`cleave.plan`, `cleave.launch`, ...; a top-level module such as
`cleave.errors` or `cleave.serve` is its own). A command-line module (`cleave.cli` and every
module it registers as a command or a benchmark) counts with its package for cycles, and no
module outside the command line may import one.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "python"
PACKAGE = SOURCE / "cleave"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(module: str, path: Path) -> set[str]:
    """The `cleave` modules `module` imports, anywhere in its file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1 more
                here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join([*here, base] if base else here)
            # `from cleave.x import y`: y may be a module of its own
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        found.update(n for n in names if n in MODULES and n != module)
    return found


def _command_modules() -> set[str]:
    """`cleave.cli` and every module in its COMMANDS and BENCHMARKS tables, read from its source
    (the same tables `cleave --help` lists)."""
    tree = ast.parse((PACKAGE / "cli.py").read_text())
    modules = {"cleave.cli"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in ("COMMANDS", "BENCHMARKS") for t in node.targets
        ):
            for entry in node.value.values:
                modules.add(entry.elts[0].value)
    return modules


COMMAND_MODULES = _command_modules()


def _node(module: str) -> str:
    """The graph node a module belongs to: its package."""
    return ".".join(module.split(".")[:2])


def _graph() -> dict[str, dict[str, list[str]]]:
    """node -> node it imports -> the module-level edges behind it ("a -> b")."""
    graph: dict[str, dict[str, list[str]]] = {}
    for module, path in MODULES.items():
        for target in sorted(_imported(module, path)):
            a, b = _node(module), _node(target)
            if a != b:
                graph.setdefault(a, {}).setdefault(b, []).append(f"{module} -> {target}")
    return graph


def _cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One cycle of nodes (first node repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_sees_the_packages_and_commands():
    # Guards the test itself: an empty graph or a missed command table passes trivially.
    assert {"cleave.serve", "cleave.plan.cli", "cleave.bench.serve"} <= COMMAND_MODULES
    graph = _graph()
    assert "cleave.settings" in graph.get("cleave.plan", {})  # the plan reads the schema
    assert "cleave.plan" in graph.get("cleave.serve", {})


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": []}, "b": {}}) is None


def test_no_cycle_among_packages():
    graph = _graph()
    cycle = _cycle(graph)
    if cycle:
        edges = [f"  {e}" for a, b in itertools.pairwise(cycle) for e in graph[a][b]]
        raise AssertionError(
            "import cycle: " + " -> ".join(cycle) + "\nthrough:\n" + "\n".join(edges)
        )


def test_only_the_command_line_imports_command_modules():
    wrong = [
        f"{module} -> {target}"
        for module, path in MODULES.items()
        if module not in COMMAND_MODULES
        for target in sorted(_imported(module, path))
        if target in COMMAND_MODULES
    ]
    assert not wrong, "below the command line, imports of command modules:\n" + "\n".join(wrong)


def test_bundle_metadata_reads_without_torch(tmp_path):
    # A manifest as the partitioner writes it, read back by the one reader everyone uses.
    manifest = {
        "format": "cleave-bundle",
        "version": 1,
        "inputs": [{"name": "ids", "role": "ids"}],
        "outputs": [],
        "output_spec": "",
        "tables": [{"name": "t", "rows": 4, "dim": 2, "dtype": "float32", "row_bytes": 8}],
        "features": [
            {"name": "f", "table": "t", "ids": "ids", "pooling": "sum", "layout": "fixed"}
        ],
        "boundary": [],
        "dense": {"inputs": []},
        "shared_inputs": [],
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    code = (
        "import sys; from pathlib import Path\n"
        "from cleave.bundle.manifest import read\n"
        f"assert read(Path({str(tmp_path)!r}))['tables'][0]['rows'] == 4\n"
        "import cleave.plan.planner\n"
        "print('torch' in sys.modules)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SOURCE), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "reading a manifest (or planning) imported torch"
