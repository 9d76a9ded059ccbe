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
from support.kafka import Broker  # noqa: E402
from support.served import SCALES, Served  # noqa: E402

# The modules that take longest, longest first (seconds within the parallel suite on a 2-core
# machine, measured 2026-11-26: docs/testing.md). Parallel runs hand whole modules to workers
# (--dist loadfile) in collection order, so these start at once instead of ending the run
# alone. Only the run's length depends on this list.
LONGEST_FIRST = [
    "test_score.py",  # 281
    "test_ray_runner.py",  # 253
    "test_serve_bench.py",  # 238
    "test_serve.py",  # 198
    "test_serve_bench_overload.py",  # 141
    "test_torchrec.py",  # 134
    "test_partition.py",  # 131
    "test_binary_tensors.py",  # 101
    "test_incast_bench.py",  # 100
    "test_serve_bench_testbed.py",  # 82
    "test_models.py",  # 88
    "test_dense_precision.py",  # 84
    "test_tier.py",  # 80
    "test_tritonclient.py",  # 78
    "test_executables.py",  # 77
    "test_serve_bench_torchrec.py",  # 75
    "test_grpc_clients.py",  # 65
    "test_router_cache.py",  # 35
    "test_repository_update.py",  # 22
    "test_shm_transport.py",  # 18-34 (44 on a loaded machine); four transports since shm9
    "test_testbed_serve.py",  # 118, after the other testbed module: they share one lock
    "test_testbed_racks.py",  # 19-32, testbed too
    "test_size_validate.py",  # 48 alone, testbed too
    "test_repository_testbed.py",  # 18 alone, testbed too
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within


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
