"""Child processes of a test: one `Process` class (output collected line by line, shown when
a wait fails; its "ready ..." line parsed; SIGTERM then SIGKILL on stop), and what /proc says
about a launcher's children."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

from cleave.bench.harness.processes import process_table, processes_below

from support.waiting import wait_for

START_S = 120.0  # a bound on start-up, never a timing assertion


def cli(*args: str) -> list[str]:
    """The command line of `cleave ARGS` with this interpreter."""
    return [sys.executable, "-m", "cleave.cli", *args]


class Process:
    """A child whose stdout and stderr are collected, in order, into `lines`. Roles print one
    "ready ADDRESS [key=value ...]" line once they serve (the address they bound: port 0 is
    fine); `wait_ready_line()` waits for it."""

    def __init__(self, argv: list[str], env: dict | None = None, name: str = ""):
        self.argv = argv
        self.name = name or Path(argv[0]).name
        self.lines: list[str] = []
        self.ready_line = ""
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=env,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            if line.startswith("ready ") and not self.ready_line:
                self.ready_line = line
            self.lines.append(line)

    @property
    def address(self) -> str:
        """What the ready line says it serves on (`HOST:PORT`, `unix:PATH` or a URL)."""
        return self.ready_line.split()[1] if self.ready_line else ""

    @property
    def metrics_url(self) -> str:
        m = re.search(r"metrics=(\S+)", self.ready_line)
        assert m, f"{self.name}: no metrics URL on its ready line {self.ready_line!r}"
        return m.group(1)

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready_line(self, timeout_s: float = START_S) -> Process:
        """Waits for the "ready ..." line; fails at once (with the output) if the child exits."""
        self._wait(lambda: self.ready_line, "its ready line", timeout_s)
        return self

    def wait_ready(self, url: str, timeout_s: float = START_S) -> Process:
        """Polls GET `url` until 200; fails at once (with the output) if the child exits."""
        self._wait(lambda: get(url)[0] == 200, f"GET {url} to answer 200", timeout_s)
        return self

    def _wait(self, predicate, what: str, timeout_s: float) -> None:
        def done():
            if predicate():
                return True
            if self.proc.poll() is not None:
                raise AssertionError(f"exited with code {self.proc.returncode} before {what}")
            return False

        try:
            wait_for(done, what, timeout_s)
        except AssertionError as err:
            self.stop()  # joins the reader: the output below is complete
            raise AssertionError(f"{self.name}: {err}; its output:\n{self.output()}") from None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Sends `sig` if it runs, waits; SIGKILL after `timeout_s`. Its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        return self.proc.returncode

    def json_lines(self) -> list[dict]:
        """Every line that looks like an object must be one (the "ready" line is for people)."""
        return [json.loads(line) for line in self.lines if line.startswith("{")]


def get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """GET `url`: (status, body); (0, why) when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError as err:
        return 0, str(err)


# -- /proc -----------------------------------------------------------------------------------


def children(pid: int) -> dict[str, int]:
    """A launcher's roles by name (shard-0, ranker-1, router), from /proc."""
    found = {}
    for child, cmdline in processes_below(pid).items():
        if Path(cmdline[0]).name == "cleave-router":
            found["router"] = child
        for arg in cmdline:
            for role in ("shard", "ranker"):
                if arg.endswith(".sock") and f"/{role}-" in arg:
                    found[Path(arg).stem] = child
    return found


def parent_of(pid: int) -> int:
    """Its parent's pid, from /proc."""
    return process_table()[pid][0]


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc."""
    return list(processes_below(pid))


def namespaces_of_testbeds() -> set[str]:
    """The testbed's network namespaces on this machine (`cleave-*`)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    return {line.split()[0] for line in out.stdout.splitlines() if line.startswith("cleave-")}
