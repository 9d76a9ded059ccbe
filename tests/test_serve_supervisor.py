"""The launcher's supervisor on small real child processes (Python one-liners serving
`/ready` over HTTP): readiness from the probe, failures named with the child's output and the
probe's last answer, restarts, ordered stop, SIGKILL after the grace time.
Also the table-range plan and the config file."""

from __future__ import annotations

import io
import sys
import textwrap
import threading
import time

import pytest
from cleave.errors import UsageError
from cleave.launch.supervisor import ChildFailed, ChildSpec, Supervisor, backoff_s
from cleave.plan.planner import table_ranges
from cleave.serve import say_ready
from cleave.settings import config_file
from support.waiting import wait_for

# Serves GET /ready (200) in a thread on its --metrics-port (0: a free one) and says which on
# its ready line: what every role does.
SERVE_READY = """
import http.server, sys, threading
PORT = int(sys.argv[2])
class _Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/ready" else 404)
        self.end_headers()
    def log_message(self, *_):
        pass
def say_ready(port):
    print(f"ready fake metrics=http://127.0.0.1:{port}", flush=True)
def serve_ready():
    server = http.server.HTTPServer(("127.0.0.1", PORT), _Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    say_ready(server.server_address[1])
"""


def child(name: str, body: str) -> ChildSpec:
    """Given port 0: the supervisor learns its port from its ready line."""
    code = SERVE_READY + textwrap.dedent(body)
    return ChildSpec(
        name,
        [sys.executable, "-c", code, "--metrics-port", "0"],
        f"unix:/tmp/{name}",
        probe="http://127.0.0.1:0",
    )


READY_THEN_WAIT = """
    import signal, sys, time
    out = sys.argv[3] if len(sys.argv) > 3 else None
    def stop(*_):
        if out:
            open(out, "a").write(NAME + "\\n")
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    print("starting up", flush=True)
    serve_ready()
    while True:
        time.sleep(0.05)
"""


def waiting(name: str, record=None) -> ChildSpec:
    spec = child(name, f"NAME = {name!r}\n" + textwrap.dedent(READY_THEN_WAIT))
    if record:
        spec.argv.append(str(record))
    return spec


def test_start_waits_for_ready_probes_and_stop_goes_newest_group_first(tmp_path):
    record = tmp_path / "stopped"
    log = io.StringIO()
    sup = Supervisor(log=log)
    try:
        first = sup.start([waiting("shard-0", record), waiting("ranker-0", record)], 30)
        (router,) = sup.start([waiting("router", record)], 30)
        assert all(c.ready.is_set() and c.last_answer == "200" for c in [*first, router])
    finally:
        codes = sup.stop(10)
    assert codes == {"router": 0, "shard-0": 0, "ranker-0": 0}
    stopped = record.read_text().split()
    assert stopped[0] == "router" and sorted(stopped[1:]) == ["ranker-0", "shard-0"]
    assert "[shard-0] starting up" in log.getvalue()


class OverlapLog:
    """A log that counts writes made while another is in progress (a text stream is not
    thread-safe: overlapping writes can run one line into the next)."""

    def __init__(self):
        self.busy, self.overlaps, self.writes = False, 0, []

    def write(self, text: str) -> None:
        if self.busy:
            self.overlaps += 1
        self.busy = True
        time.sleep(0.0005)  # widens the window an unlocked writer would race in
        self.writes.append(text)
        self.busy = False

    def flush(self) -> None:
        pass


CHATTY = """
    import signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    for i in range(100):
        print(f"out {i}", flush=True)
        print(f"err {i}", file=sys.stderr, flush=True)
    serve_ready()
    while True:
        time.sleep(0.05)
"""


def test_each_line_of_every_child_is_logged_whole_in_one_write():
    log = OverlapLog()
    sup = Supervisor(log=log)
    try:
        sup.start([child("shard-0", CHATTY), child("shard-1", CHATTY)], 30)
        # The pipes' readers may still be behind the children's ready lines.
        last = [f"[{n}] {s} 99\n" for n in ("shard-0", "shard-1") for s in ("out", "err")]
        wait_for(lambda: all(line in log.writes for line in last), "every line logged", 30)
    finally:
        sup.stop(10)
    assert log.overlaps == 0
    for name in ("shard-0", "shard-1"):
        for stream in ("out", "err"):
            for i in range(100):
                assert f"[{name}] {stream} {i}\n" in log.writes, (name, stream, i)


def test_child_exiting_before_ready_is_named_with_its_output():
    sup = Supervisor(log=io.StringIO())
    crash = child("shard-2", "import sys; print('no table t9', file=sys.stderr); sys.exit(3)")
    with pytest.raises(ChildFailed) as err:
        sup.start([waiting("ranker-0"), crash], 30)
    sup.stop(5)
    message = str(err.value)
    assert "shard-2 (pid" in message and "unix:/tmp/shard-2" in message
    assert "exited with code 3 before it was ready" in message and "no table t9" in message


def test_child_not_ready_in_time_is_named_with_its_probe_url_and_answer():
    sup = Supervisor(log=io.StringIO())
    body = """
        import socket, time
        s = socket.socket()
        s.bind(("127.0.0.1", 0))  # bound, never listening: nothing answers there
        say_ready(s.getsockname()[1])
        print('loading', flush=True)
        time.sleep(60)
        """
    slow = child("ranker-1", body)
    with pytest.raises(ChildFailed) as err:
        sup.start([slow], 1)
    sup.stop(5)
    message = str(err.value)
    assert not slow.ready_url.endswith(":0/ready")  # the port its ready line said
    assert "ranker-1 (pid" in message and "was not ready after 1 s" in message
    assert f"GET {slow.ready_url} answered no HTTP answer" in message and "loading" in message


def test_a_child_given_port_0_that_never_says_its_port_is_not_probed():
    sup = Supervisor(log=io.StringIO())
    mute = child("shard-4", "import time; print('mapping tables', flush=True); time.sleep(60)")
    with pytest.raises(ChildFailed) as err:
        sup.start([mute], 1)
    sup.stop(5)
    message = str(err.value)
    assert "shard-4 (pid" in message and "was not ready after 1 s" in message
    assert "it printed no ready line" in message and "mapping tables" in message


def test_a_ready_line_gives_the_spec_its_bound_ports_for_restarts():
    spec = ChildSpec(
        "ranker-0",
        ["cleave", "ranker", "--listen", "127.0.0.1:0", "--metrics-port", "0"]
        + ["--control-port", "0", "--threads", "0"],
        "127.0.0.1:0",
        probe="http://127.0.0.1:0",
    )
    assert spec.binds_its_own_port
    spec.take_reported(
        "ready 127.0.0.1:4101 device=cpu mode=dense metrics=http://127.0.0.1:4102"
        " control=127.0.0.1:4103"
    )
    want = ["cleave", "ranker", "--listen", "127.0.0.1:4101", "--metrics-port", "4102"]
    assert spec.argv == want + ["--control-port", "4103", "--threads", "0"]  # not --threads
    assert (spec.address, spec.probe) == ("127.0.0.1:4101", "http://127.0.0.1:4102")
    assert spec.reported["control"] == "127.0.0.1:4103" and not spec.binds_its_own_port
    router = ChildSpec(
        "router", ["cleave-router", "r.json"], "http 0.0.0.0:0", probe="https://127.0.0.1:0"
    )
    router.take_reported("listening http://0.0.0.0:4104 grpc=0.0.0.0:4105")
    assert (router.address, router.probe) == ("http 0.0.0.0:4104", "https://127.0.0.1:4104")
    assert router.reported["grpc"] == "0.0.0.0:4105"


def test_a_probe_answering_503_keeps_the_child_unready():
    sup = Supervisor(log=io.StringIO())
    body = """
        import http.server, threading, time
        class Busy(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(503)
                self.end_headers()
                self.wfile.write(b"loading tables")
            def log_message(self, *_):
                pass
        server = http.server.HTTPServer(("127.0.0.1", PORT), Busy)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        say_ready(server.server_address[1])
        time.sleep(60)
        """
    busy = child("shard-3", body)
    with pytest.raises(ChildFailed, match=r"answered 503 loading tables"):
        sup.start([busy], 2)
    sup.stop(5)


def test_watch_with_fail_stop_reports_a_dead_child_and_returns_1():
    log = io.StringIO()
    sup = Supervisor(fail_stop=True, log=log)
    (spec,) = sup.start([waiting("shard-1")], 30)
    spec.proc.kill()
    assert sup.watch(30) == 1
    sup.stop(5)
    assert "shard-1 (pid" in log.getvalue() and "was killed by SIGKILL" in log.getvalue()
    assert "stopping the deployment" in log.getvalue()


def watching(sup: Supervisor) -> tuple[threading.Thread, dict]:
    result: dict = {}
    watcher = threading.Thread(target=lambda: result.setdefault("code", sup.watch(30)))
    watcher.start()
    return watcher, result


def test_watch_restarts_a_dead_child_by_default_while_the_others_keep_running():
    log = io.StringIO()
    sup = Supervisor(log=log)
    first, other = sup.start([waiting("shard-1"), waiting("ranker-0")], 30)
    first.proc.kill()
    watcher, result = watching(sup)
    try:
        wait_for(lambda: sup.restarts.get("shard-1") == 1, "shard-1 to be restarted")
        fresh = sup.children[0]
        assert fresh is not first and fresh.ready.is_set() and fresh.proc.poll() is None
        assert sup.children[1] is other and other.proc.poll() is None  # never touched
        assert "restarting it in 0.5 s (restart 1 in a row)" in log.getvalue()
        assert "is ready again" in log.getvalue()
    finally:
        sup.request_stop()
        watcher.join(10)
        sup.stop(5)
    assert result["code"] == 0


def test_a_child_that_keeps_dying_is_restarted_with_growing_backoff(tmp_path):
    starts = tmp_path / "starts"
    log = io.StringIO()
    sup = Supervisor(log=log)
    # Ready at once the first time, then exits before it is ready on every restart.
    flaky = child(
        "ranker-1",
        f"""
        import pathlib, sys, time
        p = pathlib.Path({str(starts)!r})
        n = int(p.read_text()) if p.exists() else 0
        p.write_text(str(n + 1))
        if n:
            sys.exit(4)
        serve_ready()
        time.sleep(60)
        """,
    )
    (first,) = sup.start([flaky], 30)
    first.proc.kill()
    watcher, result = watching(sup)
    try:
        wait_for(lambda: "restart 3 in a row" in log.getvalue(), "the third restart")
        assert sup.restarts.get("ranker-1") is None  # never ready again
    finally:
        sup.request_stop()
        watcher.join(10)
        sup.stop(5)
    text = log.getvalue()
    assert "restarting it in 0.5 s (restart 1 in a row)" in text
    assert "restart failed: ranker-1 (pid" in text and "exited with code 4 before it was" in text
    assert "restarting it in 1.0 s (restart 2 in a row)" in text
    assert "restarting it in 2.0 s (restart 3 in a row)" in text
    assert result["code"] == 0


def test_backoff_doubles_up_to_its_cap():
    assert [backoff_s(a) for a in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert backoff_s(7) == 30.0 and backoff_s(60) == 30.0


def stubborn(name: str) -> ChildSpec:
    """A child that ignores SIGTERM."""
    return child(
        name,
        """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        serve_ready()
        time.sleep(60)
        """,
    )


def test_a_child_ignoring_sigterm_is_killed_after_the_grace_time():
    log = io.StringIO()
    sup = Supervisor(log=log)
    sup.start([stubborn("router")], 30)
    codes = sup.stop(0.5)
    assert codes["router"] == -9 and "did not stop in" in log.getvalue()


def test_a_retired_child_is_killed_at_once_the_others_keep_running():
    log = io.StringIO()
    sup = Supervisor(log=log)
    try:
        old, new = sup.start([stubborn("ranker-old"), waiting("ranker-new")], 30)
        sup.retire({"ranker-old"}, 30)  # no grace time spent: it is killed
        assert old.proc.returncode == -9 and "did not stop in" not in log.getvalue()
        assert [c.spec.name for c in sup.children] == ["ranker-new"]
        assert new.proc.poll() is None
    finally:
        sup.stop(10)


# -- the plan and the config file ----------------------------------------------------------


def test_table_ranges_cut_every_table_into_contiguous_ranges():
    manifest = {"tables": [{"name": "a", "rows": 10}, {"name": "b", "rows": 2}]}
    plan = table_ranges(manifest, 3)
    assert plan == [{"a": (0, 3)}, {"a": (3, 6), "b": (0, 1)}, {"a": (6, 10), "b": (1, 2)}]
    for table in manifest["tables"]:
        ranges = sorted(p[table["name"]] for p in plan if table["name"] in p)
        assert ranges[0][0] == 0 and ranges[-1][1] == table["rows"]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_config_file_overrides_defaults_and_names_bad_keys(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("shards = 3\nfail_stop = true\n[ranker]\nmax_wait_ms = 2\ndevice = 'cpu'\n")
    config = config_file.load(path).check()
    assert (config.shards, config.fail_stop, config.ranker.max_wait_ms) == (3, True, 2.0)
    assert config.rankers == 1 and config.ranker.max_batch == 256
    path.write_text("[ranker]\nthreads = true\n")
    with pytest.raises(UsageError, match=r"ranker.threads must be an integer, got bool True"):
        config_file.load(path)
    path.write_text("restart = true\n")
    with pytest.raises(UsageError, match=r"key 'restart' was removed: restarts are the default"):
        config_file.load(path)
    path.write_text("[shard]\nspeed = 1\n")
    known = "dram_budget, queue, threads"
    with pytest.raises(UsageError, match=rf"unknown key 'shard.speed'; known keys here: {known}"):
        config_file.load(path)
    path.write_text("router = 3\n")
    with pytest.raises(UsageError, match=r"\[router\] must be a table"):
        config_file.load(path)
    path.write_text("[router]\nidle_timeout_ms = 0\n")
    with pytest.raises(UsageError, match=r"router.idle_timeout_ms: expected at least 1, got 0"):
        config_file.load(path).check()
    path.write_text("transport = 'udp'\n")
    expected = r'transport: expected "unix", "shm", "tcp" or "mptcp", got \'udp\''
    with pytest.raises(UsageError, match=expected):
        config_file.load(path).check()
    path.write_text("monolithic = true\nrankers = 2\n")
    with pytest.raises(UsageError, match=r"rankers: expected 1 with monolithic, got 2"):
        config_file.load(path).check()


def test_the_ready_lines_are_written_whole_each_in_one_write():
    """print() wrote `ready URL` and its newline in two calls (with PYTHONUNBUFFERED), so a
    role's log line on stderr could land between them in a pipe that takes both streams, and
    the reader take the URL with the line's first word glued to it."""

    class Writes:
        def __init__(self):
            self.calls: list[str] = []

        def write(self, text: str) -> int:
            self.calls.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    out = Writes()
    say_ready(["http://127.0.0.1:8000", "http://127.0.0.1:8001"], out)
    assert out.calls == ["ready http://127.0.0.1:8000\n", "ready http://127.0.0.1:8001\n"]
