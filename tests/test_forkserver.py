"""The fork server (cleave/launch/forkserver.py) with real rankers: a forked ranker serves as
one started on its own would, shows its own command line, takes the environment and directory
it was given, reports its exit code; bad requests are refused and the server goes on; when the
server dies its children die with it."""

from __future__ import annotations

import json
import os
import signal
import socket

import pytest
from cleave.launch.forkserver import ForkServer
from support.processes import get, parent_of
from support.waiting import wait_for


@pytest.fixture(scope="module")
def server():
    fork_server = ForkServer()
    yield fork_server
    fork_server.close()


def ranker_argv(bundle, tmp_path, name="ranker-0") -> list[str]:
    listen = f"unix:{tmp_path / name}.sock"
    flags = ["--bundle", str(bundle), "--listen", listen, "--metrics-port", "0"]
    return ["-m", "cleave.cli", "ranker", *flags]


def ready_line(proc) -> str:
    for line in proc.stdout:  # bounded: the ranker prints it, or exits and the pipe closes
        if line.startswith("ready "):
            return line
    raise AssertionError(f"no ready line; exit code {proc.wait(30)}: {proc.stderr.read()}")


def cmdline(pid: int) -> list[str]:
    return open(f"/proc/{pid}/cmdline", "rb").read().rstrip(b"\0").decode().split("\0")


def test_a_forked_ranker_serves_shows_its_command_line_and_reports_its_exit(
    models, tmp_path, server
):
    argv = ranker_argv(models["dlrm"].dir, tmp_path)
    quiet = dict(os.environ, CLEAVE_LOG="warning")  # its own, not the server's
    proc = server.spawn(argv, quiet, str(tmp_path))
    metrics = dict(w.split("=", 1) for w in ready_line(proc).split() if "=" in w)["metrics"]
    status, body = get(f"{metrics}/ready")
    assert status == 200, body
    assert parent_of(proc.pid) == server.proc.pid
    assert cmdline(proc.pid)[1:] == argv
    assert os.readlink(f"/proc/{proc.pid}/cwd") == str(tmp_path)
    assert proc.poll() is None
    proc.terminate()  # the ranker's orderly stop
    assert proc.wait(30) == 0
    assert " INFO " not in proc.stderr.read()

    told = dict(os.environ, CLEAVE_LOG="info")
    killed = server.spawn(ranker_argv(models["dlrm"].dir, tmp_path, "ranker-1"), told, "/")
    ready_line(killed)
    killed.kill()
    assert killed.wait(30) == -signal.SIGKILL
    assert " INFO cleave.ranker" in killed.stderr.read()
    killed.kill()  # after its exit: nothing is signalled (its pid may be another's now)


def test_a_ranker_that_cannot_start_exits_with_its_error(tmp_path, server):
    proc = server.spawn(ranker_argv(tmp_path / "no-bundle", tmp_path), dict(os.environ), "/")
    assert proc.wait(60) == 2
    assert "no-bundle" in proc.stderr.read()


@pytest.mark.parametrize(
    "message, fds, says",
    [
        (b"not json", 2, "expected a JSON object"),
        (json.dumps({"argv": [], "env": {}, "cwd": "/"}).encode(), 2, "expected a JSON"),
        (json.dumps({"argv": ["ranker"], "env": {}, "cwd": "/"}).encode(), 2, '["-m", module'),
        (json.dumps({"argv": ["-m", "m"], "env": {"A": 1}, "cwd": "/"}).encode(), 2, "expected"),
        (json.dumps({"argv": ["-m", "m"], "env": {}, "cwd": "/"}).encode(), 0, "0 descriptors"),
        (json.dumps([1, 2]).encode(), 1, "expected a JSON object"),
    ],
)
def test_a_malformed_request_is_refused_and_the_server_goes_on(
    models, tmp_path, server, message, fds, says
):
    pipes = [os.pipe() for _ in range(fds)]
    with server._lock:  # the wire as the supervisor's side would write it, but wrong
        socket.send_fds(server._sock, [message], [w for _, w in pipes])
        reply = server._reply(30)
    for r, w in pipes:
        os.close(r)
        os.close(w)
    assert "pid" not in reply and says in reply["error"], reply
    proc = server.spawn(ranker_argv(models["dlrm"].dir, tmp_path), dict(os.environ), "/")
    ready_line(proc)
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL


def test_children_die_with_the_server(models, tmp_path):
    server = ForkServer()  # its own: this test kills it
    proc = server.spawn(ranker_argv(models["dlrm"].dir, tmp_path), dict(os.environ), "/")
    ready_line(proc)
    pid = proc.pid
    server.proc.kill()
    assert proc.wait(30) == -signal.SIGKILL  # as the supervisor's side sees it
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), "the forked ranker to be gone", 30)
    assert not server.alive
    with pytest.raises(Exception, match="fork server"):
        server.spawn(["-m", "cleave.cli", "ranker", "--help"], dict(os.environ), "/")
    assert server.proc.wait(5) == -signal.SIGKILL
