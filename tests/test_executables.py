"""The standalone executables `cleave-shard` and `cleave-router` (docs/serving.md,
"Executables and images"): they link no Python; the command lines of deploy/docker's
Dockerfiles (ENTRYPOINT + CMD, with the binaries of .venv/bin) serve a real bundle in an empty
environment (`env -i`: no Python on PATH, no PYTHONPATH) and become ready on `/ready`; JSON
logs are one object per line and carry a failing request's trace id (its `x-request-id`) in
both the router's and the shard's lines; SIGTERM drains and exits 0; bad flags and configs
exit 2 naming the flag or field. Readiness of `cleave serve` from probes is here too: a role
whose `/ready` never turns 200 fails the start naming the role and the URL; every role's
metrics URL is printed and scrapable; a killed shard comes back on the same ports."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cleave.launch.process import ServeProcess
from cleave.launch.supervisor import find_executable
from support.processes import Process, cli, get, processes_below
from support.router import whole_tables
from support.served import Served
from support.shards import write_bundle
from support.waiting import wait_for

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "deploy" / "docker"
START_S = 120.0  # a bound on start-up, never a timing assertion


def instruction(dockerfile: Path, name: str) -> list[str]:
    """The exec form (a JSON list) of a Dockerfile's last ENTRYPOINT or CMD."""
    found = None
    for line in dockerfile.read_text().splitlines():
        if line.startswith(f"{name} "):
            found = json.loads(line[len(name) + 1 :])
    assert isinstance(found, list), f"{dockerfile.name}: no {name} in exec form"
    return found


def image_argv(dockerfile: str, replace: dict[str, str]) -> list[str]:
    """What the image runs (ENTRYPOINT + CMD), with its executable taken from .venv/bin and
    the image's paths and ports swapped for this test's."""
    path = DOCKER / dockerfile
    entry, cmd = instruction(path, "ENTRYPOINT"), instruction(path, "CMD")
    argv = [replace.get(a, a) for a in entry + cmd]
    return [find_executable(argv[0]), *argv[1:]]


def post(url: str, body: bytes) -> tuple[int, dict, str]:
    """(status, JSON body, x-request-id)."""
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), response.headers["x-request-id"]
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers["x-request-id"]


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env={})


# -- the binaries ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cleave-shard", "cleave-router"])
def test_executables_link_no_python(name):
    path = find_executable(name)
    assert shutil.which("ldd"), "ldd is needed to read the executable's libraries"
    libraries = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=30).stdout
    assert "libc.so" in libraries, libraries  # ldd did read it
    assert "libpython" not in libraries, libraries
    assert b"libpython" not in Path(path).read_bytes()  # not even a dlopen by name


def test_shard_refuses_bad_flags_with_exit_2_naming_the_flag(tmp_path):
    shard = find_executable("cleave-shard")
    cases = [
        (["--listen", "127.0.0.1:0"], "--bundle"),
        (["--bundle", str(tmp_path), "--listen", "nowhere"], "--listen"),
        (["--bundle", str(tmp_path), "--listen", "127.0.0.1:0", "--threads", "0"], "--threads"),
        (["--bundle", str(tmp_path), "--listen", "127.0.0.1:0", "--rows", "9:x"], "--rows"),
        (
            ["--bundle", str(tmp_path), "--listen", "127.0.0.1:0", "--frame-timeout", "-1"],
            "--frame-timeout",
        ),
        (["--bundle", str(tmp_path), "--listen", "127.0.0.1:0", "--log-format", "xml"], "xml"),
    ]
    for flags, named in cases:
        result = run([shard, *flags])
        assert result.returncode == 2, (flags, result.stderr)
        assert named in result.stderr, (flags, result.stderr)


def test_shard_input_errors_exit_2_and_start_failures_exit_1(tmp_path):
    shard = find_executable("cleave-shard")
    result = run([shard, "--bundle", str(tmp_path), "--listen", "127.0.0.1:0"])
    assert result.returncode == 2 and f"{tmp_path}/manifest.json" in result.stderr
    write_bundle(tmp_path / "bundle")
    with socket.socket() as taken:  # a port in use: only starting finds that out
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [shard, "--bundle", str(tmp_path / "bundle"), "--listen", f"127.0.0.1:{port}"]
        result = run(argv)
    assert result.returncode == 1 and f"127.0.0.1:{port}" in result.stderr, result.stderr


def test_router_refuses_a_bad_config_with_exit_2_naming_the_field(tmp_path):
    router = find_executable("cleave-router")
    missing = tmp_path / "missing.json"
    result = run([router, str(missing)])
    assert result.returncode == 2 and f"cannot read {missing}" in result.stderr
    bad = tmp_path / "bad.json"
    config = {"model": "m", "bundle": str(tmp_path), "shards": [], "rankers": ["127.0.0.1:1"]}
    bad.write_text(json.dumps({**config, "admit_share": 2.0}))
    result = run([router, "--check", str(bad)])
    assert result.returncode == 2 and str(bad) in result.stderr
    assert "admit_share is 2" in result.stderr
    bad.write_text(json.dumps({**config, "budget_ms": "soon"}))
    result = run([router, str(bad)])
    assert result.returncode == 2 and "budget_ms" in result.stderr
    result = run([router, "--log-format", "xml", str(bad)])
    assert result.returncode == 2 and "--log-format" in result.stderr
    good = tmp_path / "good.json"
    good.write_text(json.dumps(config))
    result = run([router, "--check", str(good)])
    assert result.returncode == 0 and result.stdout.strip() == f"{good}: ok"


def test_a_router_pinned_to_one_core_starts_one_thread_of_each_kind(models, tmp_path):
    """`threads` (default 2) HTTP workers and as many backend I/O threads, but no more than
    the cores the router may run on: pinned to one (taskset), one of each, and a log line
    says so; more would only take turns on that core (docs/api.md, `threads`)."""
    served = models["shared"]
    manifest = json.loads((served.dir / "manifest.json").read_text())
    config = {
        "model": served.name,
        "bundle": str(served.dir),
        "host": "127.0.0.1",
        # Nothing listens there: the router waits for them, which is enough here.
        "shards": whole_tables(manifest, "127.0.0.1:1"),
        "rankers": ["127.0.0.1:1"],
    }
    path = tmp_path / "router.json"
    path.write_text(json.dumps(config))
    core = min(os.sched_getaffinity(0))
    router = Process(["taskset", "-c", str(core), find_executable("cleave-router"), str(path)])
    try:
        wait_for(lambda: any("listening http://" in line for line in router.lines), "listening")
        tasks = Path(f"/proc/{router.proc.pid}/task")
        names = sorted((t / "comm").read_text().strip() for t in tasks.iterdir())
        # The main thread and one worker carry the runtime's name; the I/O thread its own,
        # cut to the kernel's 15 bytes.
        io = "cleave-router-io-0"[:15]
        assert names == ["cleave-router", "cleave-router", io], names
        assert any("threads capped" in line and "configured=2" in line for line in router.lines)
    finally:
        router.stop()


def test_cleave_shard_subcommand_is_the_executable(tmp_path):
    """`cleave shard` execs cleave-shard: the same flags, messages and exit codes."""
    result = subprocess.run(
        [sys.executable, "-m", "cleave.cli", "shard", "--listen", "nowhere", "--bundle", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "invalid value 'nowhere' for '--listen" in result.stderr


# -- the images' command lines against a real bundle -----------------------------------------


class Images:
    """A shard and a router as their images run them (empty environment, JSON logs) and a
    ranker (`cleave ranker`, Python) between them. The shard holds row 0 of every table only
    while the router is told it holds every row: a lookup of any other row fails at the shard,
    which gives a request that fails with a trace id in both logs."""

    def __init__(self, served: Served, root: Path):
        self.served = served
        self.children: list[Process] = []
        # Port 0 everywhere: each binds its own and says which on its "ready" line.
        argv = image_argv(
            "shard.Dockerfile",
            {"/bundle": str(served.dir), "0.0.0.0:7000": "127.0.0.1:0", "9100": "0"},
        )
        self.shard = self._start(argv + ["--rows", "0:1"], env={})
        self.shard_probe = self.shard.metrics_url.removesuffix("/metrics")
        ranker_argv = cli("ranker", "--bundle", str(served.dir), "--listen", "127.0.0.1:0")
        ranker_argv += ["--threads", "1", "--device", "cpu", "--metrics-port", "0"]
        self.ranker = self._start(ranker_argv, None)
        manifest = json.loads((served.dir / "manifest.json").read_text())
        config = {
            "model": served.name,
            "bundle": str(served.dir),
            "host": "127.0.0.1",
            "http_port": 0,
            "shards": whole_tables(manifest, self.shard.address),
            "rankers": [self.ranker.address],
            "budget_ms": 20000,
            "threads": 1,
        }
        path = root / "router.json"
        path.write_text(json.dumps(config))
        argv = image_argv("router.Dockerfile", {"/etc/cleave/router.json": str(path)})
        self.router = self._start(argv, env={})
        self.url = self.router.address

    def _start(self, argv: list[str], env: dict | None) -> Process:
        """Started and ready: its ready line read, then its /ready answering 200."""
        child = Process(argv, env)
        self.children.append(child)
        try:
            child.wait_ready_line(START_S)
            probe = child.address if child.address.startswith("http") else child.metrics_url
            child.wait_ready(f"{probe.removesuffix('/metrics')}/ready", START_S)
        except BaseException:
            self.stop()
            raise
        return child

    def stop(self) -> dict[str, int]:
        return {c.argv[0]: c.stop() for c in reversed(self.children)}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("executables")
    deployment = Images(Served("shared", root), root)
    yield deployment
    deployment.stop()


def test_images_run_without_python_and_answer_their_probes(images):
    for child, probe in [(images.shard, images.shard_probe), (images.router, images.url)]:
        assert child.proc.poll() is None
        status, body = get(f"{probe}/ready")
        assert status == 200 and json.loads(body)["status"] == "ready", body
        assert get(f"{probe}/live")[0] == 200
    # The empty environment reached them: nothing there to find Python with.
    environ = Path(f"/proc/{images.shard.proc.pid}/environ").read_bytes()
    assert b"PATH=" not in environ and b"PYTHONPATH" not in environ


def test_a_failing_requests_trace_id_is_in_the_router_and_shard_json_logs(images):
    url = f"{images.url}/v2/models/{images.served.name}/infer"
    body, _ = images.served.request(64)  # some id is surely not row 0
    status, reply, trace_id = post(url, body)
    assert status >= 400, reply
    assert len(trace_id) == 16 and int(trace_id, 16)

    def logged():  # the log lines are written before the reply; reading them may lag
        router = [r for r in images.router.json_lines() if r.get("trace_id") == trace_id]
        shard = [r for r in images.shard.json_lines() if r.get("trace_id") == trace_id]
        return (router, shard) if router and shard else None

    router, shard = wait_for(logged, f"trace id {trace_id} in the router's and shard's logs")
    assert router and router[0]["level"] == "WARN" and router[0]["message"] == "request failed"
    assert shard and shard[0]["level"] == "WARN" and shard[0]["message"] == "lookup refused"
    assert "outside rows [0, 1)" in shard[0]["error"], shard[0]


def test_sigterm_drains_and_exits_0(images):
    # Last in this module: it stops the deployment.
    codes = images.stop()
    assert set(codes.values()) == {0}, codes
    assert any(line.startswith("ready http://") for line in images.router.lines)


# -- cleave serve's readiness comes from probes ----------------------------------------------


FAKE_ROUTER = """#!{python}
# A stand-in for cleave-router: serves its config's port (0: a free one), says which as the
# router does once bound, but /ready answers 503 forever.
import http.server, json, sys
config = json.load(open(sys.argv[-1]))
class Starting(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503)
        self.end_headers()
        self.wfile.write(b"starting")
    def log_message(self, *_):
        pass
server = http.server.HTTPServer((config["host"], config["http_port"]), Starting)
print(f"listening http://{{config['host']}}:{{server.server_address[1]}}", flush=True)
server.serve_forever()
"""


def test_serve_fails_when_a_roles_ready_never_turns_200_naming_role_and_url(tmp_path):
    """`cleave serve` with CLEAVE_BIN_DIR holding the real cleave-shard and a router whose
    /ready never answers 200: the start fails (exit 1) naming the router and its probe URL."""
    served = Served("shared", tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "cleave-shard").symlink_to(find_executable("cleave-shard"))
    fake = bin_dir / "cleave-router"
    fake.write_text(FAKE_ROUTER.format(python=sys.executable))
    fake.chmod(0o755)
    config = tmp_path / "serve.toml"
    config.write_text("ready_timeout_s = 20\n[ranker]\ndevice = 'cpu'\nthreads = 1\n")
    result = subprocess.run(
        [sys.executable, "-m", "cleave.cli", "serve", str(served.dir), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CLEAVE_BIN_DIR": str(bin_dir)},
    )
    assert result.returncode == 1, result.stderr
    assert "router (pid" in result.stderr and "was not ready after 20 s" in result.stderr
    assert "/ready answered 503 starting" in result.stderr, result.stderr
    assert "ready http" not in result.stdout


def shard_pids(parent: int) -> dict[frozenset, tuple[int, list[str]]]:
    """cleave-shard children of `parent` by their rows (`--rows`), from /proc."""
    found = {}
    for pid, argv in processes_below(parent).items():
        if argv[0].endswith("cleave-shard"):
            found[frozenset(argv[argv.index("--rows") + 1].split(","))] = (pid, argv)
    return found


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_serve_prints_every_roles_metrics_url_and_a_restart_keeps_its_ports(tmp_path):
    served = Served("shared", tmp_path)
    config = tmp_path / "serve.toml"
    config.write_text("shards = 2\ntransport = 'tcp'\n[ranker]\ndevice = 'cpu'\nthreads = 1\n")
    with ServeProcess(served.dir, "--config", str(config)) as server:
        lines = [line for line in server.log if line.startswith("cleave serve: metrics ")]
        urls = dict(line.split()[-2:] for line in lines)
        assert sorted(urls) == ["ranker-0", "router", "shard-0", "shard-1"], lines
        for url in urls.values():
            status, text = get(url)
            assert status == 200 and "cleave_" in text, (url, text[:200])
        # shard-0 was given port 0 for both; its ready line says what it bound.
        (ready,) = [line.split() for line in server.log if line.startswith("[shard-0] ready ")]
        address, words = ready[2], dict(w.split("=", 1) for w in ready[3:] if "=" in w)
        probe, rows = words["metrics"], frozenset(words["tables"].split(","))
        assert urls["shard-0"] == f"{probe}/metrics"
        pid, _ = shard_pids(server.proc.pid)[rows]
        os.kill(pid, signal.SIGKILL)

        def restarted() -> bool:
            pid_now, argv = shard_pids(server.proc.pid).get(rows, (pid, []))
            return pid_now != pid and get(f"{probe}/ready")[0] == 200

        wait_for(restarted, "shard-0 to be restarted and ready", START_S)
        # Back with the same data address and metrics port: its command line names them.
        _, argv = shard_pids(server.proc.pid)[rows]
        assert (flag(argv, "--listen"), flag(argv, "--metrics-port")) == (
            address,
            probe.rsplit(":", 1)[1],
        )
        assert server.stop() == 0


def test_testbed_runner_refuses_unix_transport_before_making_anything(tmp_path):
    """Its roles would serve their probes on their namespace's loopback, out of reach."""
    from cleave.errors import UsageError
    from cleave.plan import local_plan
    from cleave.runners.testbed import TestbedRunner
    from cleave.settings import ServeConfig

    write_bundle(tmp_path / "bundle")
    for transport in ("unix", "shm"):  # shm: testbed hosts share no memory either
        plan = local_plan(tmp_path / "bundle", ServeConfig(transport=transport))
        runner = TestbedRunner()
        refused = rf"transport: '{transport}' cannot run on the testbed"
        with pytest.raises(UsageError, match=refused):
            runner.start(plan, tmp_path)
        assert runner.testbed is None
