"""The tests' own layering (docs/testing.md): shared test code lives in tests/support and
fixtures in conftest.py; no test module imports another test module, and support imports no
test module either."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_test_modules(source: str) -> set[str]:
    """The test_* modules `source` imports, at any depth (imports inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n for n in names if n.split(".")[0].startswith("test_")}
    return found


def test_the_check_sees_every_form_of_import():
    source = "import test_a\nfrom test_b import x\ndef f():\n    from test_c.d import y\n"
    assert imported_test_modules(source) == {"test_a", "test_b", "test_c.d"}
    assert not imported_test_modules("from support.served import Served\nimport testing\n")


def test_no_test_module_imports_another():
    offenders = {
        str(path.relative_to(TESTS)): sorted(imported)
        for path in sorted(TESTS.rglob("*.py"))
        if (imported := imported_test_modules(path.read_text()))
    }
    assert not offenders, f"move what they share to tests/support (or conftest.py): {offenders}"
