"""Fixtures shared by the test modules, and the markers' policies (docs/testing.md). What the
fixtures build is in tests/support/."""

import fcntl
import os
import sys
from pathlib import Path

import pytest

# tests/support (the shared test code) and tests/factories.py (test-only model factories)
# are importable as `support` and `factories`.
sys.path.insert(0, str(Path(__file__).parent))

from support import served  # noqa: E402
from support.helm import HELM  # noqa: E402
from support.kafka import Broker  # noqa: E402
from support.served import SCALES, Served  # noqa: E402

pytest_plugins = ["support.cpu_report"]  # --cpu-report=FILE

# The modules that take longest, longest first (seconds within the parallel suite on a 2-core
# machine, measured 2026-11-29: docs/testing.md), with the testbed modules (TB) spread among
# them: those run one at a time under a shared lock, so handed out together they would leave
# workers waiting on it. Parallel runs hand whole modules to workers (--dist loadfile) in this
# order (--no-loadscope-reorder: pytest-xdist would otherwise put the modules with the most
# tests first), so the long ones start at once instead of ending the run alone. Only the run's
# length depends on this list.
LONGEST_FIRST = [
    "test_ray_runner.py",  # 287
    "test_size_validate.py",  # 104 TB
    "test_serve_bench.py",  # 207
    "test_score.py",  # 191
    "test_shm_transport.py",  # 111
    "test_serve_bench_testbed.py",  # 68 TB
    "test_repository.py",  # 99
    "test_serve_bench_overload.py",  # 92
    "test_incast_bench.py",  # 69 TB
    "test_torchrec.py",  # 86
    "test_router_cache.py",  # 84
    "test_testbed_serve.py",  # 55 TB
    "test_dense_precision.py",  # 82
    "test_partition.py",  # 73
    "test_testbed_racks.py",  # 45 TB
    "test_serve.py",  # 71
    "test_tier.py",  # 69
    "test_runners.py",  # 35 TB
    "test_sizing.py",  # 65
    "test_update.py",  # 53
    "test_repository_testbed.py",  # 18 TB
    "test_stream.py",  # 52
    "test_binary_tensors.py",  # 50
    "test_testbed.py",  # 17 TB
    "test_executables.py",  # 46
    "test_bench_rack_testbed.py",  # 16 TB
    "test_models.py",  # 45
    "test_bench_refusal.py",  # 44
    "test_serve_bench_torchrec.py",  # 42
    "test_tritonclient.py",  # 85 with the gRPC clients, before one deployment served both
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within


@pytest.fixture(scope="session", autouse=True)
def reference_bundles(tmp_path_factory):
    """One directory of reference bundles for the session's workers (`support.served.CACHE`):
    the parent of a worker's base temp is the session's, shared by its workers."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    served.CACHE = root / "reference-bundles"
    served.CACHE.mkdir(exist_ok=True)


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


class _Models(dict):
    """Reference models with their bundles, each partitioned when a test first asks for it
    (a worker that needs one model does not export all of them)."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> Served:
        if name not in SCALES:
            raise KeyError(name)
        served = self[name] = Served(name, self.root)
        return served


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Served]:
    """Every reference model with its bundle (read only: tests never write into it)."""
    return _Models(tmp_path_factory.mktemp("bundles"))


@pytest.fixture(scope="session")
def helm() -> Path:
    assert HELM.exists(), f"{HELM} is missing: `make tools` builds it (test-python runs it)"
    return HELM


@pytest.fixture(scope="session")
def kafka(tmp_path_factory) -> Broker:
    """One Kafka broker (a KRaft node) for the run: once per xdist worker that asks for it,
    so the streaming tests stay in one module (tests/test_stream.py)."""
    broker = Broker(tmp_path_factory.mktemp("kafka")).start()
    yield broker
    broker.stop()
