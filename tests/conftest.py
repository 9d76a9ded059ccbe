"""Fixtures shared by the test modules, and the markers' policies (docs/testing.md). What the
fixtures build is in tests/support/."""

import sys
from pathlib import Path

import pytest

# tests/support (the shared test code) and tests/factories.py (test-only model factories)
# are importable as `support` and `factories`.
sys.path.insert(0, str(Path(__file__).parent))

from support.helm import HELM  # noqa: E402
from support.served import SCALES, Served  # noqa: E402


def pytest_collection_modifyitems(items):
    # Testbed tests create namespaces and count them machine-wide: one worker runs them all,
    # one after another (with `--dist loadgroup`; without xdist the mark does nothing).
    for item in items:
        if item.get_closest_marker("testbed"):
            item.add_marker(pytest.mark.xdist_group("testbed"))


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Served]:
    """Every reference model with its bundle (read only: tests never write into it)."""
    root = tmp_path_factory.mktemp("bundles")
    return {name: Served(name, root) for name in SCALES}


@pytest.fixture(scope="session")
def helm() -> Path:
    assert HELM.exists(), f"{HELM} is missing: `make tools` builds it (test-python runs it)"
    return HELM
