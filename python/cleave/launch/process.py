"""`cleave serve` as a child process, for tools and tests that drive a deployment: starts it,
waits for its "ready URL" line, stops it with SIGTERM."""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
import threading
import time

from cleave.errors import CleaveError


class ServeProcess:
    def __init__(self, bundle, *flags: str, ready_timeout_s: float = 180.0, echo: bool = False):
        # bundle None: the flags name a plan instead (`--plan PLAN --runner testbed`).
        where = [] if bundle is None else [str(bundle)]
        self.argv = [sys.executable, "-m", "cleave.cli", "serve", *where, *flags]
        self.ready_timeout_s = ready_timeout_s
        self.echo = echo  # copy the deployment's log lines to our stderr
        self.url = ""
        # Roles log each failed request: an outage under load writes thousands of lines.
        self.log: collections.deque[str] = collections.deque(maxlen=20000)
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()

    def start(self) -> ServeProcess:
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            # One pipe for both, so lines keep the order they were written in: what `cleave
            # serve` says before `ready` (every role's metrics URL) is in `log` once it is.
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        try:
            self._wait_ready()
        except BaseException:  # not ready in time, or SIGTERM/Ctrl-C while it starts
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None:
                time.sleep(0.2)
                raise CleaveError(
                    f"cleave serve exited with code {self.proc.returncode} before it was ready:\n"
                    + "\n".join(self.log)
                )
            if time.monotonic() > deadline:
                raise CleaveError(
                    f"cleave serve was not ready after {self.ready_timeout_s:.0f} s:\n"
                    + "\n".join(self.log)
                )

    def _read(self, stream) -> None:
        for raw in stream:
            line = raw.rstrip("\n")
            if line.startswith("ready ") and not self._ready.is_set():
                self.url = line.split()[1]
                self._ready.set()
                continue
            self.log.append(line)
            if self.echo:
                print(line, file=sys.stderr, flush=True)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then wait; returns the exit code (SIGKILL after `timeout_s`)."""
        return 0 if self.proc is None else terminate(self.proc, timeout_s)

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def terminate(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM `proc` if it runs, then wait; SIGKILL after `timeout_s`. Its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
