"""Fixtures shared by the test modules, and the markers' policies (docs/testing.md). What the
fixtures build is in tests/support/."""

import fcntl
import sys
from pathlib import Path

import pytest

# tests/support (the shared test code) and tests/factories.py (test-only model factories)
# are importable as `support` and `factories`.
sys.path.insert(0, str(Path(__file__).parent))

from support.helm import HELM  # noqa: E402
from support.served import SCALES, Served  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def testbed_lock(request, tmp_path_factory):
    """Testbed tests create network namespaces and count them machine-wide, so a module with
    any runs whole while no other worker runs one: an exclusive lock on a file the session's
    workers share. (pytest-xdist's `xdist_group` does not group on pytest 9.)"""
    module = request.module
    if not any(
        i.module is module and i.get_closest_marker("testbed") for i in request.session.items
    ):
        yield
        return
    path = tmp_path_factory.getbasetemp().parent / "testbed.lock"
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Served]:
    """Every reference model with its bundle (read only: tests never write into it)."""
    root = tmp_path_factory.mktemp("bundles")
    return {name: Served(name, root) for name in SCALES}


@pytest.fixture(scope="session")
def helm() -> Path:
    assert HELM.exists(), f"{HELM} is missing: `make tools` builds it (test-python runs it)"
    return HELM
