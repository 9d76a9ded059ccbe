"""`pytest --cpu-report=FILE`: each test's CPU, written to FILE as one JSON line per test, and
the costliest modules and tests at the end of the run (docs/testing.md). The suite is CPU-bound
on 2 cores, so CPU, not wall time, says where a cut pays. Give it with `=`: pytest reads a
separate FILE argument as a path to test before it loads this plugin (tests/conftest.py), and
an existing FILE then moved the xdist workers' root away from tests/.

A test's CPU is its pytest process's (`self_s`) plus that of the children it reaped
(`children_s`, RUSAGE_CHILDREN): a process the test started and reaped counts, one reaped by
someone else (a daemon's own children, a Ray worker) does not, and a module fixture's
processes count for the test that stopped them (the module's last)."""

from __future__ import annotations

import json
import os
import resource
import time
from collections import Counter
from pathlib import Path

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-report",
        metavar="FILE",  # as --cpu-report=FILE: see above
        help="write each test's CPU to FILE (JSON lines) and print the costliest at the end",
    )


def pytest_configure(config):
    path = config.getoption("cpu_report")
    if path and not hasattr(config, "workerinput"):  # the run's first process: a new FILE
        Path(path).write_text("")


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("cpu_report")
    if not path:
        yield
        return
    started, (own, kids) = time.monotonic(), _cpu()
    yield
    own_after, kids_after = _cpu()
    line = {
        "test": item.nodeid,
        "wall_s": round(time.monotonic() - started, 3),
        "self_s": round(own_after - own, 3),
        "children_s": round(kids_after - kids, 3),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
    }
    # One short write in append mode: the xdist workers' lines do not interleave.
    with open(path, "a") as out:
        out.write(json.dumps(line) + "\n")


def pytest_terminal_summary(terminalreporter, config):
    path = config.getoption("cpu_report")
    if not path or hasattr(config, "workerinput") or not Path(path).exists():
        return
    tests, modules = Counter(), Counter()
    for text in Path(path).read_text().splitlines():
        line = json.loads(text)
        cpu = line["self_s"] + line["children_s"]
        tests[line["test"]] += cpu
        modules[line["test"].split("::")[0]] += cpu
    write = terminalreporter.write_line
    terminalreporter.section(f"CPU by test (seconds; every line in {path})")
    write(f"{sum(tests.values()):8.1f}  all {len(tests)} tests")
    for name, cpu in modules.most_common(15):
        write(f"{cpu:8.1f}  {name}")
    write("")
    for name, cpu in tests.most_common(15):
        write(f"{cpu:8.1f}  {name}")
