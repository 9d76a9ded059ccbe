"""Starts the processes of a deployment, gates on their readiness, watches them, stops them.

A child is ready when `GET /ready` on its probe URL (the health schema every role serves:
shards and rankers on their metrics port, routers on their HTTP port) answers 200. A port the
runner leaves 0 is bound by the child itself, which says which on its first stdout line
"ready ADDRESS [metrics=URL] [control=ADDR] ..." (shards, rankers) or "listening URL
[grpc=ADDR]" (routers, at bind time, before they are ready); the spec then takes those
ports (its address, probe and command line), so the probe goes there and a restart comes
back on the same ports.
Nothing picks a port and releases it for a child to bind later. Its output is forwarded to
our stderr, prefixed with its name; the last lines are kept for error messages.
Children run in their own session (a terminal's Ctrl-C reaches only the launcher, which then
stops them in order) and die with the launcher if it is killed (Linux: PR_SET_PDEATHSIG).

A child that dies is restarted after a backoff delay (doubling from 0.5 s up to 30 s, back to
the start once it has run a minute) while the others keep serving; with `fail_stop` the first
death stops the deployment instead.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from cleave.errors import CleaveError
from cleave.launch import forkserver

_TAIL_LINES = 20
_BACKOFF_FIRST_S = 0.5
_BACKOFF_MAX_S = 30.0
_STABLE_S = 60.0  # a child that ran this long since it was ready restarts without delay growth
_WATCH_TICK_S = 0.1
_PROBE_EVERY_S = 0.1
_PROBE_TIMEOUT_S = 2.0  # one GET /ready; a role busy loading may answer slowly
_BOUND = ("ready ", "listening ")  # the stdout lines that say where a child listens


class ChildFailed(CleaveError):
    """A child exited or did not become ready: names it and shows its last output."""


@dataclass
class ChildSpec:
    name: str  # "shard-0", "ranker-1", "router"
    argv: list[str]
    address: str = ""  # what it serves on, for messages
    before_start: object = None  # callable run before each (re)start, e.g. remove a socket
    probe: str = ""  # base URL of its /ready, /live, /metrics ("http://127.0.0.1:9100")
    # Its first ready line's ADDRESS and key=value words ("address", "metrics", "control").
    reported: dict[str, str] = field(default_factory=dict)
    # A `python -m cleave.cli` role a supervisor that forks may fork (forkserver.py).
    forkable: bool = False

    @property
    def ready_url(self) -> str:
        return f"{self.probe}/ready"

    @property
    def binds_its_own_port(self) -> bool:
        """Whether it was given port 0 for its address or probe: its probe waits until its
        ready (or listening) line says which port it bound."""
        return self.probe.endswith(":0") or self.address.endswith(":0")

    def take_reported(self, line: str) -> None:
        """Takes the ports a ready line reports in place of the 0s of address, probe and
        argv (`--listen`, `--metrics-port`, `--control-port`)."""
        words = line.split()
        reported = {"address": words[1]} if len(words) > 1 else {}
        reported |= dict(w.split("=", 1) for w in words[2:] if "=" in w)
        self.reported = reported
        address = reported.get("address", "")
        listens = address and "://" not in address  # a router's is its URL
        if self.address.endswith(":0"):
            self.address = with_port(self.address, port_of(address))
        self.argv = list(self.argv)
        for flag, value in (
            ("--listen", address if listens else ""),
            ("--metrics-port", str(port_of(reported.get("metrics", "")) or "")),
            ("--control-port", str(port_of(reported.get("control", "")) or "")),
        ):
            if value and flag in self.argv[:-1]:
                at = self.argv.index(flag) + 1
                if self.argv[at] == "0" or self.argv[at].endswith(":0"):
                    self.argv[at] = value
        if self.probe.endswith(":0"):  # last: the probe waits for this
            self.probe = with_port(self.probe, port_of(reported.get("metrics") or address))


def port_of(address: str) -> int:
    """The port of `HOST:PORT` or a URL; 0 when there is none."""
    tail = address.rstrip("/").rsplit(":", 1)[-1] if ":" in address else ""
    return int(tail) if tail.isdigit() else 0


def with_port(address: str, port: int) -> str:
    """`address` (ending in `:0`) with `port` instead."""
    return f"{address.removesuffix(':0')}:{port}" if port else address


@dataclass
class Child:
    spec: ChildSpec
    proc: subprocess.Popen | forkserver.ForkedProcess
    ready: threading.Event = field(default_factory=threading.Event)
    last_answer: str = "no answer yet"  # of its /ready, for messages
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_TAIL_LINES))
    started: float = field(default_factory=time.monotonic)
    ready_at: float = 0.0  # time.monotonic() of its first 200 from /ready
    said_ready: threading.Event = field(default_factory=threading.Event)  # said where it is

    def describe(self) -> str:
        where = f", {self.spec.address}" if self.spec.address else ""
        return f"{self.spec.name} (pid {self.proc.pid}{where})"

    def not_ready(self) -> str:
        if self.spec.binds_its_own_port:
            return "it printed no ready line (it binds its own ports and says which there)"
        return f"GET {self.spec.ready_url} answered {self.last_answer}"

    def output(self) -> str:
        lines = list(self.tail)
        if not lines:
            return ""
        return "\n  its last output:\n" + "\n".join(f"    {line}" for line in lines)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class _Recovery:
    """A dead child on its way back: waiting out its backoff, then starting."""

    attempt: int  # restarts in a row, this one included
    due: float  # time.monotonic() of the next start
    starting: Child | None = None
    ready_by: float = 0.0


# Probes go straight to the role, never through an HTTP proxy from the environment.
# A router with TLS (docs/security.md) is probed over https without checking its certificate:
# the probe asks our own child whether it is ready, it sends nothing secret.
_DIRECT = urllib.request.build_opener(
    urllib.request.ProxyHandler({}),
    urllib.request.HTTPSHandler(context=ssl._create_unverified_context()),
)


def probe_ready(url: str, timeout_s: float = _PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """One GET of a /ready URL: (whether it answered 200, what it answered, briefly)."""
    try:
        with _DIRECT.open(url, timeout=timeout_s) as response:
            return response.status == 200, f"{response.status}"
    except urllib.error.HTTPError as err:
        body = err.read(200).decode(errors="replace").strip()
        return False, f"{err.code} {body}".strip()
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        return False, f"no HTTP answer ({reason})"


def probe_text(url: str, timeout_s: float = _PROBE_TIMEOUT_S) -> str:
    """One GET of a role's probe URL (its /metrics, say): the body, or "" without a 200."""
    try:
        with _DIRECT.open(url, timeout=timeout_s) as response:
            return response.read().decode(errors="replace") if response.status == 200 else ""
    except (urllib.error.URLError, OSError, ValueError):
        return ""


def backoff_s(attempt: int) -> float:
    """Delay before restart number `attempt` (1, 2, ...) in a row."""
    return min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2 ** (attempt - 1))


class Supervisor:
    def __init__(
        self, fail_stop: bool = False, log=None, env: dict | None = None, fork: bool = False
    ):
        self.fail_stop = fail_stop
        self.log = log or sys.stderr
        # Every line goes out in one write under this lock: a text stream is not thread-safe,
        # and the readers of each child's two pipes and the supervisor's messages share it
        # (unlocked, a role's line once ran into the next one's prefix: measured).
        self._log_lock = threading.Lock()
        self.env = env
        self.children: list[Child] = []
        self.groups: list[list[str]] = []  # names, one list per start() call
        self.stopping = threading.Event()
        self.restarts: dict[str, int] = {}  # name -> restarts so far, for reports and tests
        self._recovering: dict[str, _Recovery] = {}
        self._attempts: dict[str, int] = {}  # name -> restarts in a row without a stable run
        # The children change while watch() runs (a model version loaded or retired).
        self._lock = threading.RLock()
        # Python roles forked from one process that imported torch (forkserver.py): where
        # several roles start on one machine, or start while others serve.
        self.fork = fork and forkserver.enabled()
        self._fork_servers: dict[tuple[str, ...], forkserver.ForkServer] = {}

    # -- starting ------------------------------------------------------------------------------
    def spawn(self, spec: ChildSpec, ready_timeout_s: float) -> Child:
        if callable(spec.before_start):
            spec.before_start()
        proc = self._start_process(spec)
        child = Child(spec, proc)
        threading.Thread(target=self._read, args=(child, proc.stdout, True), daemon=True).start()
        threading.Thread(target=self._read, args=(child, proc.stderr), daemon=True).start()
        threading.Thread(target=self._probe, args=(child, ready_timeout_s), daemon=True).start()
        return child

    def _start_process(self, spec: ChildSpec) -> subprocess.Popen | forkserver.ForkedProcess:
        argv = spec.argv
        at = _python_at(argv) if self.fork and spec.forkable else None
        if at is not None:
            # One fork server per command-line wrapping (a testbed host's namespace and CPU
            # cap): it runs where its children would, and they inherit that.
            wrap = tuple(argv[:at])
            with self._lock:
                server = self._fork_servers.get(wrap)
                if server is None or not server.alive:
                    server = forkserver.ForkServer(list(wrap), self._fork_server_says)
                    self._fork_servers[wrap] = server
            env = dict(os.environ if self.env is None else self.env)
            return server.spawn(argv[at + 1 :], env, os.getcwd())
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,
            preexec_fn=forkserver.die_with_parent if sys.platform == "linux" else None,
            env=self.env,
        )

    def _fork_server_says(self, line: str) -> None:
        self.emit(f"[fork-server] {line}")

    def _probe(self, child: Child, timeout_s: float) -> None:
        """GET /ready until 200, the child exits, we stop, or (a little after) its ready
        timeout, when the caller gives up on it anyway."""
        if not child.spec.probe:
            child.last_answer = "nothing: no probe URL was given"
            return
        deadline = time.monotonic() + timeout_s + _PROBE_TIMEOUT_S
        while time.monotonic() < deadline and child.proc.poll() is None:
            if self.stopping.is_set():
                return
            if child.spec.binds_its_own_port:  # its ready line says where to probe
                child.said_ready.wait(_PROBE_EVERY_S)
                continue
            ok, child.last_answer = probe_ready(child.spec.ready_url)
            if ok:
                child.ready_at = time.monotonic()
                child.ready.set()
                return
            time.sleep(_PROBE_EVERY_S)

    def _read(self, child: Child, stream, stdout: bool = False) -> None:
        for raw in stream:
            line = raw.rstrip("\n")
            if stdout and line.startswith(_BOUND) and not child.said_ready.is_set():
                child.spec.take_reported(line)
                child.said_ready.set()
            child.tail.append(line)
            self.emit(f"[{child.spec.name}] {line}")

    def wait_ready(self, children: list[Child], timeout_s: float) -> None:
        """Blocks until every child's /ready answered 200; raises ChildFailed naming the
        first one that exits or is not ready in time (with the probe URL and its last answer)."""
        deadline = time.monotonic() + timeout_s
        for child in children:
            while not child.ready.wait(0.05):
                code = child.proc.poll()
                if code is not None:
                    child.ready.wait(0.2)  # let the readers catch the last lines
                    raise ChildFailed(
                        f"{child.describe()} {_describe_exit(code)} before it was ready"
                        f"{child.output()}"
                    )
                if self.stopping.is_set():
                    raise ChildFailed(f"stopped while waiting for {child.describe()}")
                if time.monotonic() > deadline:
                    raise ChildFailed(
                        f"{child.describe()} was not ready after {timeout_s:.0f} s: "
                        f"{child.not_ready()}{child.output()}"
                    )

    def start(self, specs: list[ChildSpec], timeout_s: float) -> list[Child]:
        """Starts children together (they load in parallel), then waits for all of them."""
        with self._lock:
            started = [self.spawn(spec, timeout_s) for spec in specs]
            self.children.extend(started)
            self.groups.append([spec.name for spec in specs])
        self.wait_ready(started, timeout_s)
        return started

    def retire(self, names: set[str], timeout_s: float) -> None:
        """Stops these children for good (nothing restarts them): a model version unloaded
        (drained first: nothing is sent to it any more), or one whose load failed. They are
        killed, not asked to stop: a ranker's orderly shutdown (1.7 s of Python and torch
        teardown) disturbed the versions still serving on the same core, even at idle CPU
        priority (`cleave bench repository`, half load on one core: 3-35 refused in the
        unload before, none in seven runs since; docs/benchmarks.md)."""
        with self._lock:
            gone = [c for c in self.children if c.spec.name in names]
            self.children = [c for c in self.children if c.spec.name not in names]
            self.groups = [g for g in ([n for n in g if n not in names] for g in self.groups) if g]
            for name in names:
                self._recovering.pop(name, None)
                self._attempts.pop(name, None)
        for child in gone:
            if child.proc.poll() is None:
                child.proc.kill()
        self._terminate(gone, timeout_s)

    # -- watching ------------------------------------------------------------------------------
    def watch(self, ready_timeout_s: float) -> int:
        """Until stop(): returns 0 when stopped. A dead child is restarted with backoff while
        the others keep serving; with `fail_stop`, returns 1 as soon as a child dies."""
        while not self.stopping.wait(_WATCH_TICK_S):
            with self._lock:
                if self._watch_once(ready_timeout_s):
                    return 1
        return 0

    def _watch_once(self, ready_timeout_s: float) -> bool:
        """One look at every child; True when fail-stop says to stop."""
        for i, child in enumerate(self.children):
            if self.stopping.is_set():
                break
            recovery = self._recovering.get(child.spec.name)
            if recovery is None:
                code = child.proc.poll()
                if code is None:
                    continue
                what = f"{child.describe()} {_describe_exit(code)}"
                if self.fail_stop:
                    self.say(f"{what}; stopping the deployment (fail-stop){child.output()}")
                    return True
                self._schedule(child, f"{what}{child.output()}")
            elif recovery.starting is None:
                if time.monotonic() >= recovery.due:
                    fresh = self.spawn(child.spec, ready_timeout_s)
                    recovery.starting = self.children[i] = fresh
                    recovery.ready_by = time.monotonic() + ready_timeout_s
            else:
                self._follow_start(child, recovery, ready_timeout_s)
        return False

    def _schedule(self, child: Child, what: str) -> None:
        name = child.spec.name
        stable = child.ready.is_set() and time.monotonic() - child.ready_at >= _STABLE_S
        attempt = 1 if stable else self._attempts.get(name, 0) + 1
        self._attempts[name] = attempt
        delay = backoff_s(attempt)
        self._recovering[name] = _Recovery(attempt, time.monotonic() + delay)
        self.say(f"{what}\n  restarting it in {delay:.1f} s (restart {attempt} in a row)")

    def _follow_start(self, child: Child, recovery: _Recovery, ready_timeout_s: float) -> None:
        name = child.spec.name
        if child.ready.is_set():
            del self._recovering[name]
            self.restarts[name] = self.restarts.get(name, 0) + 1
            self.say(f"{child.describe()} is ready again")
            return
        code = child.proc.poll()
        if code is None and time.monotonic() < recovery.ready_by:
            return
        if code is None:
            child.proc.kill()
            child.proc.wait()
            why = f"was not ready after {ready_timeout_s:.0f} s ({child.not_ready()}); killed it"
        else:
            why = f"{_describe_exit(code)} before it was ready"
        del self._recovering[name]
        self._schedule(child, f"restart failed: {child.describe()} {why}{child.output()}")

    def emit(self, line: str) -> None:
        """Writes one whole line to the log."""
        try:
            with self._log_lock:
                self.log.write(line + "\n")
                self.log.flush()
        except (ValueError, OSError):  # our stderr is gone; the deployment goes on
            pass

    def say(self, message: str) -> None:
        self.emit(f"cleave serve: {message}")

    # -- stopping ------------------------------------------------------------------------------
    def request_stop(self) -> None:
        self.stopping.set()

    def stop(self, timeout_s: float) -> dict[str, int]:
        """SIGTERM to the children, one start() group at a time, newest group first (the
        router stops before the rankers and shards it calls); SIGKILL to any child still
        running after `timeout_s`. Returns each child's exit code by name."""
        self.stopping.set()
        with self._lock:
            by_name = {child.spec.name: child for child in self.children}
            groups = list(self.groups)
        codes = {}
        for group in reversed(groups):
            children = [by_name[name] for name in group]
            self._terminate(children, timeout_s)
            codes.update((child.spec.name, child.proc.returncode) for child in children)
        for server in self._fork_servers.values():
            server.close()
        return codes

    def _terminate(self, children: list[Child], timeout_s: float) -> None:
        """SIGTERM to all, then SIGKILL to any still running after `timeout_s`."""
        for child in children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.say(f"{child.describe()} did not stop in {timeout_s:.0f} s; killing it")
                child.proc.kill()
                child.proc.wait()


def _python_at(argv: list[str]) -> int | None:
    """Where `python -m cleave.cli` starts in `argv` (after a runner's wrapping), or None."""
    prefix = python_argv()
    return next((i for i in range(len(argv)) if argv[i : i + len(prefix)] == prefix), None)


def python_argv(*args: str) -> list[str]:
    """A child command line that runs `cleave` with this interpreter (no PATH lookup)."""
    return [sys.executable, "-m", "cleave.cli", *args]


EXECUTABLES = ("cleave-shard", "cleave-router")


def find_executable(name: str) -> str:
    """The path of a standalone executable (`cleave-shard`, `cleave-router`): in
    $CLEAVE_BIN_DIR if set, else beside this interpreter (where `make setup` installs them),
    else on PATH."""
    assert name in EXECUTABLES, name
    bin_dir = os.environ.get("CLEAVE_BIN_DIR")
    if bin_dir:
        path = Path(bin_dir) / name
        if os.access(path, os.X_OK):
            return str(path)
        raise CleaveError(
            f"{name}: not found in CLEAVE_BIN_DIR={bin_dir}; expected an executable {path} "
            f"(cargo build --release -p {name}, then copy target/release/{name} there)"
        )
    beside = Path(sys.executable).parent / name
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found:
        return found
    raise CleaveError(
        f"{name}: not found beside {sys.executable} nor on PATH; build it with `make setup` "
        f"(or `cargo install --path crates/{name}`), or set CLEAVE_BIN_DIR to its directory"
    )
