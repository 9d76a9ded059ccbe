"""The emulated multi-host testbed (cleave.testbed) on real network namespaces: reachability,
shaping, link flaps, cleanup of crashed owners, the CLI. Needs CAP_NET_ADMIN; every test
removes what it made, and the module checks that no cleave-* namespace, clv* interface or
state file is left behind."""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
from cleave.errors import UsageError
from cleave.testbed import Testbed, TestbedError, commands, naming, resources, state, tcp
from cleave.testbed.owner import PROCESS, Owner, start_time
from support.waiting import wait_for


def _netns_probe() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if not commands.has_net_admin():
        return "needs CAP_NET_ADMIN (run as root) to create network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    probe = f"clvprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


_SKIP = _netns_probe()
pytestmark = [pytest.mark.testbed, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]

IO_TIMEOUT_S = 10.0

# Echoes each connection's bytes until EOF; exits after 60 s without a connection.
ECHO_SERVER = """
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0)); s.listen(16); s.settimeout(60)
print("ready", s.getsockname()[1], flush=True)
def echo(c):
    with c:
        c.settimeout(10)
        while data := c.recv(65536):
            c.sendall(data)
while True:
    try:
        conn, _ = s.accept()
    except TimeoutError:
        break
    threading.Thread(target=echo, args=(conn,), daemon=True).start()
"""

# Counts one connection's bytes until EOF and answers the count; one connection, then exits.
SINK_SERVER = """
import socket
s = socket.socket(); s.bind(("0.0.0.0", 0)); s.listen(1); s.settimeout(60)
print("ready", s.getsockname()[1], flush=True)
conn, _ = s.accept(); conn.settimeout(30); total = 0
while data := conn.recv(1 << 20):
    total += len(data)
conn.sendall(b"%d\\n" % total); conn.close()
"""

# Connects, sends a token, prints what came back.
ECHO_CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as c:
    c.sendall(b"ping"); c.shutdown(socket.SHUT_WR); print(c.recv(16).decode())
"""


# -- helpers ---------------------------------------------------------------------------------


def _kernel_objects() -> tuple[set[str], set[str], set[str]]:
    """Testbed namespaces, root-namespace interfaces and state files that exist now."""
    ns = {n for n in resources.netns_names() if n.startswith("cleave-")}
    links = {link["ifname"] for link in resources.links()}
    links = {name for name in links if naming.slot_of_link(name) is not None}
    files = {p.name for p in state.STATE_DIR.glob("*.json")} if state.STATE_DIR.is_dir() else set()
    return ns, links, files


@pytest.fixture(scope="module", autouse=True)
def no_leftovers():
    before = _kernel_objects()
    yield
    after = _kernel_objects()
    new = [sorted(a - b) for a, b in zip(after, before, strict=True)]
    # A testbed another running process owns (a concurrent run) is theirs, not a leftover.
    states, _ = state.read_all()
    theirs = {
        slot
        for slot, inst in states.items()
        if inst.owner.kind == PROCESS and inst.owner.pid != os.getpid() and inst.owner.alive()
    }
    new[0] = [n for n in new[0] if naming.slot_of_netns(n) not in theirs]
    new[1] = [n for n in new[1] if naming.slot_of_link(n) not in theirs]
    new[2] = [f for f in new[2] if int(f.removesuffix(".json")) not in theirs]
    for slot in {naming.slot_of_netns(n) for n in new[0]} | {
        naming.slot_of_link(n) for n in new[1]
    }:
        resources.remove_slot(slot)  # clean up, then fail below
    for f in new[2]:
        (state.STATE_DIR / f).unlink(missing_ok=True)
    assert new == [[], [], []], f"left behind (namespaces, links, state files): {new}"


@pytest.fixture
def make_testbed():
    made: list[Testbed] = []

    def make(*args, **kw) -> Testbed:
        tb = Testbed(*args, **kw)
        made.append(tb)
        return tb.up()

    yield make
    for tb in made:
        tb.down()


def _read_ready(proc: subprocess.Popen) -> int:
    """The port from the server's "ready PORT" line, waiting at most IO_TIMEOUT_S."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout=IO_TIMEOUT_S):
            raise AssertionError(f"no ready line from {proc.args} within {IO_TIMEOUT_S} s")
    finally:
        sel.close()
    line = proc.stdout.readline().split()
    assert line[:1] == ["ready"], f"expected 'ready PORT' from {proc.args}, got {line}"
    return int(line[1])


def _start(tb: Testbed, host, script: str, *args: str) -> int:
    proc = tb.popen(host, [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
    return _read_ready(proc)


def _echo(addr: str, port: int, timeout: float = 5.0) -> bytes:
    with socket.create_connection((addr, port), timeout=timeout) as conn:
        conn.sendall(b"ping")
        conn.shutdown(socket.SHUT_WR)
        return conn.recv(16)


def _echo_from(tb: Testbed, host, addr: str, port: int) -> str:
    done = tb.run(
        host, [sys.executable, "-c", ECHO_CLIENT, addr, str(port)], capture_output=True, text=True
    )
    assert done.returncode == 0, f"client in {host} -> {addr}:{port} failed: {done.stderr}"
    return done.stdout.strip()


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cleave.cli", "testbed", *args],
        capture_output=True,
        text=True,
        timeout=60,
        **kw,
    )


def _free_slots(count: int) -> list[int]:
    """Slots at the top of the range with nothing on record or in the kernel."""
    states, broken = state.read_all()
    busy = set(states) | set(broken) | resources.slots_present()
    free = [s for s in range(naming.SLOTS - 1, -1, -1) if s not in busy]
    return free[:count]


# -- tests -----------------------------------------------------------------------------------


def test_hosts_reach_each_other_and_the_root_namespace(make_testbed):
    tb = make_testbed(3)
    h0, h1, h2 = tb.hosts
    subnet = naming.Names(tb.slot).subnet
    assert [h.name for h in tb.hosts] == ["h0", "h1", "h2"]
    assert h0.netns == f"cleave-{tb.slot}-h0" and h2.veth == f"clv{tb.slot}h2"
    assert h0.address == str(subnet.network_address + 11)
    assert tb.root_address == str(subnet.network_address + 1)
    assert subnet.subnet_of(naming.RANGE)

    port = _start(tb, h0, ECHO_SERVER, "0.0.0.0")
    assert _echo(h0.address, port) == b"ping"  # root -> host
    assert _echo_from(tb, h1, h0.address, port) == "ping"  # host -> host
    assert _echo_from(tb, h2, h0.address, port) == "ping"
    assert _echo_from(tb, h0, "127.0.0.1", port) == "ping"  # a host's own loopback

    # host -> root: a server in the root namespace on its bridge address
    root_server = subprocess.Popen(
        [sys.executable, "-c", ECHO_SERVER, tb.root_address], stdout=subprocess.PIPE, text=True
    )
    try:
        root_port = _read_ready(root_server)
        assert _echo_from(tb, h2, tb.root_address, root_port) == "ping"
    finally:
        root_server.kill()
        root_server.wait(timeout=IO_TIMEOUT_S)

    # Nothing leads out of the testbed: hosts have only their /24, no default route.
    for h in tb.hosts:
        routes = commands.ip("-n", h.netns, "-4", "route", "show")
        assert "default" not in routes and str(subnet) in routes, routes


def test_every_link_direction_is_shaped_with_htb(make_testbed):
    tb = make_testbed(2, 0.25, burst_kb=32, queue_kb=128)
    for h in tb.hosts:
        for where, dev in ((["-n", h.netns], h.veth), ([], h.bridge_port)):
            qdiscs = commands.tc(*where, "qdisc", "show", "dev", dev)
            classes = commands.tc(*where, "class", "show", "dev", dev)
            assert "qdisc htb 1: root" in qdiscs and "default 0x10" in qdiscs, qdiscs
            assert "qdisc bfifo 10: parent 1:10 limit 128Kb" in qdiscs, qdiscs
            assert "class htb 1:1 root rate 250Mbit ceil 250Mbit" in classes, classes
            assert "class htb 1:10 parent 1:1 leaf 10:" in classes, classes


def test_hosts_and_the_route_to_them_use_the_retransmission_floor(make_testbed):
    tb = make_testbed(2, 1.0, rto_min_ms=4)
    route = commands.ip("-4", "route", "show", str(tb.subnet))
    assert "rto_min lock 4ms" in route, route  # iproute2 locks the metric it is given
    if tcp.SYSCTL.exists():
        for h in tb.hosts:
            floor = commands.ip("netns", "exec", h.netns, "sysctl", "-n", tcp.SYSCTL_KEY)
            assert floor.strip() == "4000", floor
    # The kernel's own, where asked: the root namespace's route keeps no floor.
    kernel = make_testbed(1, 1.0, rto_min_ms=0)
    assert "rto_min" not in commands.ip("-4", "route", "show", str(kernel.subnet))


def _bulk_gbit(tb: Testbed, nbytes: int) -> float:
    """Gbit/s of one TCP transfer of ``nbytes`` from the root namespace to h0, timed until
    the receiver has counted every byte."""
    port = _start(tb, tb.hosts[0], SINK_SERVER)
    chunk = b"\0" * (1 << 20)
    with socket.create_connection((tb.hosts[0].address, port), timeout=IO_TIMEOUT_S) as conn:
        start = time.perf_counter()
        for _ in range(nbytes // len(chunk)):
            conn.sendall(chunk)
        conn.shutdown(socket.SHUT_WR)
        reply = conn.makefile().readline()
        elapsed = time.perf_counter() - start
    assert int(reply) == nbytes // len(chunk) * len(chunk), f"sink counted {reply!r}"
    return int(reply) * 8 / elapsed / 1e9


def test_shaping_limits_a_bulk_transfer(make_testbed):
    nbytes = 12 << 20  # about 1 s at 0.1 Gbit/s
    shaped = _bulk_gbit(make_testbed(1, 0.1), nbytes)
    unshaped = _bulk_gbit(make_testbed(1, 100.0), nbytes)
    # Functional band, not a performance claim: shaping applies and lands near the rate.
    assert 0.03 <= shaped <= 0.13, f"0.1 Gbit/s link carried {shaped:.3f} Gbit/s"
    assert shaped < unshaped / 2, f"shaped {shaped:.3f} vs unshaped {unshaped:.3f} Gbit/s"


def test_set_link_cuts_and_restores_a_host(make_testbed):
    tb = make_testbed(2)
    h0, h1 = tb.hosts
    port = _start(tb, h0, ECHO_SERVER, "0.0.0.0")
    assert _echo(h0.address, port) == b"ping"

    tb.set_link(h0, False)
    with pytest.raises(OSError):  # a timeout or "no route to host", never an answer
        _echo(h0.address, port, timeout=1.0)
    cut = tb.run(h1, [sys.executable, "-c", ECHO_CLIENT, h0.address, str(port)], timeout=15)
    assert cut.returncode != 0

    tb.set_link(h0, True)

    def echoes() -> bool:  # the port may take a moment to forward again
        try:
            return _echo(h0.address, port, timeout=1.0) == b"ping"
        except OSError:
            return False

    wait_for(echoes, "h0 to answer again once its link is up", 5.0)
    assert _echo_from(tb, h1, h0.address, port) == "ping"


def test_down_removes_everything_and_is_idempotent():
    tb = Testbed(2).up()
    try:
        slot = tb.slot
        sleeper = tb.popen(tb.hosts[1], ["sleep", "60"])
        ns = [h.netns for h in tb.hosts]
        assert set(ns) <= set(resources.netns_names())
        assert state.path_of(slot).exists()
    finally:
        tb.down()
    assert sleeper.poll() is not None, "a process started in a host outlived down()"
    assert not set(ns) & set(resources.netns_names())
    assert slot not in resources.slots_present()
    assert not state.path_of(slot).exists()
    tb.down()  # idempotent
    with pytest.raises(UsageError, match="not up"):
        _ = tb.hosts


def test_a_failing_up_leaves_nothing_behind(monkeypatch):
    before = _kernel_objects()
    real = commands.run_tool
    calls = {"tc": 0}

    def failing(argv, **kw):
        if argv[0] == "tc":
            calls["tc"] += 1
            if calls["tc"] == 6:  # the second direction of host 0 is being shaped
                argv = ["tc", "qdisc", "add", "dev", "clvnosuchdev", "root", "htb"]
        return real(argv, **kw)

    monkeypatch.setattr(commands, "run_tool", failing)
    tb = Testbed(2)
    with pytest.raises(TestbedError, match=r"`tc qdisc add dev clvnosuchdev root htb` failed.*"):
        tb.up()
    monkeypatch.undo()
    assert _kernel_objects() == before
    tb.down()  # a no-op after the rollback


def test_leftovers_of_dead_owners_are_removed_live_ones_kept(make_testbed):
    dead_slot, reused_slot, live_slot = _free_slots(3)
    gone = subprocess.Popen(["sleep", "60"])
    gone_start = start_time(gone.pid)
    gone.kill()
    gone.wait(timeout=IO_TIMEOUT_S)
    alive = subprocess.Popen(["sleep", "60"])
    me = os.getpid()
    owners = {
        dead_slot: Owner(PROCESS, gone.pid, gone_start or 0),  # crashed owner
        reused_slot: Owner(PROCESS, me, (start_time(me) or 0) + 1),  # pid reused since
        live_slot: Owner(PROCESS, alive.pid, start_time(alive.pid) or 0),  # still running
    }
    try:
        for slot, owner in owners.items():
            state.write(
                state.InstanceState(
                    slot, f"pytest-{uuid.uuid4().hex[:8]}", 1, 1.0, 64, 256, owner, time.time()
                )
            )
            commands.ip("netns", "add", naming.Names(slot).netns(0))
            commands.ip("link", "add", naming.Names(slot).bridge, "type", "bridge")
        make_testbed(1)
        present = resources.slots_present()
        for slot in (dead_slot, reused_slot):
            assert slot not in present and not state.path_of(slot).exists(), slot
        assert live_slot in present and state.path_of(live_slot).exists()
    finally:
        for slot in owners:
            resources.remove_slot(slot)
            state.remove(slot)
        alive.kill()
        alive.wait(timeout=IO_TIMEOUT_S)


def test_a_state_file_round_trips_and_one_without_racks_reads_as_none():
    owner = Owner(PROCESS, os.getpid(), start_time(os.getpid()) or 0)
    racked = state.InstanceState(3, "r", 8, 0.1, 64, 256, owner, 1.0, racks=2, rack_mode="pool")
    assert state.InstanceState.from_json(racked.to_json()) == racked
    older = racked.to_json()
    del older["racks"], older["rack_mode"]  # written before racks were recorded
    plain = state.InstanceState.from_json(older)
    assert (plain.racks, plain.rack_mode) == (0, "")


def test_cli_up_list_down_round_trip(make_testbed):
    name = f"pytest-{uuid.uuid4().hex[:8]}"
    try:
        made = _cli("up", "--hosts", "2", "--link-gbit", "0.5", "--name", name)
        assert made.returncode == 0, made.stderr
        lines = [line.split() for line in made.stdout.splitlines()]
        assert [row[0] for row in lines] == ["h0", "h1", "root"], made.stdout
        assert all(row[1] in resources.netns_names() for row in lines[:2])
        root_address = lines[2][2]
        assert root_address.startswith("198.1") and lines[0][2] != root_address

        # The CLI's process has exited; its testbed is kept, also by another up()'s reclaim.
        make_testbed(1).down()
        listed = _cli("list")
        assert listed.returncode == 0, listed.stderr
        row = next(line for line in listed.stdout.splitlines() if line.startswith(name))
        assert "live" in row and "cli" in row, listed.stdout
        assert all(row[1] in resources.netns_names() for row in lines[:2])

        gone = _cli("down", "--name", name)
        assert gone.returncode == 0, gone.stderr
        assert not {row[1] for row in lines[:2]} & set(resources.netns_names())
        assert name not in _cli("list").stdout
    finally:
        _cli("down", "--name", name)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hosts", "0"], "hosts must be 1..200, got 0"),
        (["--hosts", "201"], "hosts must be 1..200, got 201"),
        (["--hosts", "2", "--link-gbit", "0"], "link_gbit must be > 0"),
        (["--hosts", "2", "--link-gbit", "-1"], "link_gbit must be > 0"),
        (["--hosts", "2", "--name", "no spaces"], "name must be"),
        (["--hosts", "two"], "invalid int value"),
        (["--hosts", "2", "--rto-min-ms", "201"], "rto_min_ms must be 0 (the kernel's) to 200"),
        (["--hosts", "2", "--rto-min-ms", "-1"], "rto_min_ms must be 0 (the kernel's) to 200"),
    ],
)
def test_cli_rejects_bad_input(args, message):
    before = _kernel_objects()
    bad = _cli("up", *args)
    assert bad.returncode == 2 and message in bad.stderr, bad.stderr
    assert _kernel_objects() == before


def test_cli_rejects_a_name_in_use_and_missing_privileges():
    name = f"pytest-{uuid.uuid4().hex[:8]}"
    try:
        assert _cli("up", "--hosts", "1", "--name", name).returncode == 0
        before = _kernel_objects()
        again = _cli("up", "--hosts", "1", "--name", name)
        assert again.returncode == 2 and f"name {name!r} is in use" in again.stderr, again.stderr
        assert _kernel_objects() == before
    finally:
        assert _cli("down", "--name", name).returncode == 0

    if shutil.which("setpriv") is None:
        pytest.skip("setpriv is needed to drop CAP_NET_ADMIN")
    before = _kernel_objects()
    unprivileged = subprocess.run(
        ["setpriv", "--bounding-set", "-net_admin", "--", sys.executable, "-m", "cleave.cli"]
        + ["testbed", "up", "--hosts", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unprivileged.returncode == 2, unprivileged.stderr
    assert "needs CAP_NET_ADMIN" in unprivileged.stderr, unprivileged.stderr
    assert _kernel_objects() == before


def test_sigterm_removes_the_testbed_of_its_owner():
    script = (
        "import sys, time\n"
        "from cleave.testbed import Testbed\n"
        "tb = Testbed(1).up()\n"
        "print(tb.slot, flush=True)\n"
        "time.sleep(30)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        sel = selectors.DefaultSelector()
        sel.register(owner.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=IO_TIMEOUT_S), "the owner did not report its testbed"
        sel.close()
        slot = int(owner.stdout.readline())
        assert slot in resources.slots_present()
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(timeout=IO_TIMEOUT_S) == 128 + signal.SIGTERM
        assert slot not in resources.slots_present() and not state.path_of(slot).exists()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=IO_TIMEOUT_S)


# Answers frames on h0 (control kinds in Rust, data kinds echoed here) for up to 60 s.
FRAME_SERVER = """
import sys, time
from cleave._native import FrameServer
s = FrameServer(sys.argv[1] + ":0")
print("ready", s.address.rsplit(":", 1)[1], flush=True)
end = time.monotonic() + 60
while time.monotonic() < end:
    for conn, rid, kind, payload, *_ in s.recv(64, 0.2):
        s.reply(conn, rid, kind, payload)
"""


def _class_bytes(dev: str, classid: str, netns: str | None = None) -> int:
    """Bytes htb class ``classid`` on ``dev`` has sent."""
    where = ["-n", netns] if netns else []
    lines = commands.tc(*where, "-s", "class", "show", "dev", dev).splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"class htb {classid} "):
            return int(lines[i + 1].split()[1])  # " Sent N bytes M pkt ..."
    raise AssertionError(f"no class {classid} on {dev}: {lines}")


def test_control_connections_take_the_priority_class_and_data_does_not(make_testbed):
    from cleave._native import CONTROL_DSCP, FrameClient

    tb = make_testbed(1, 0.5)
    tb.prioritize_dscp(CONTROL_DSCP)
    (h0,) = tb.hosts
    server = tb.popen(
        h0, [sys.executable, "-c", FRAME_SERVER, h0.address], stdout=subprocess.PIPE, text=True
    )
    try:
        client = FrameClient(f"{h0.address}:{_read_ready(server)}", timeout_s=IO_TIMEOUT_S)
        client.ping()  # connects both classes' first connection
        before = {
            "to h0": _class_bytes(h0.bridge_port, "1:5"),
            "from h0": _class_bytes(h0.veth, "1:5", h0.netns),
        }
        data_before = _class_bytes(h0.bridge_port, "1:10")
        for _ in range(20):
            client.ping()  # control frames: marked by the client, answered marked
        assert client.call(0x0200, b"x" * 200_000) == b"x" * 200_000  # data: unmarked
        control_to = _class_bytes(h0.bridge_port, "1:5") - before["to h0"]
        control_from = _class_bytes(h0.veth, "1:5", h0.netns) - before["from h0"]
        data = _class_bytes(h0.bridge_port, "1:10") - data_before
        assert control_to > 0 and control_from > 0, (control_to, control_from)
        assert data >= 200_000, f"the data frame went in the default class: {data}"
        assert control_to < 50_000, (
            f"only the control frames are in the priority class: {control_to}"
        )
    finally:
        server.kill()
        server.wait(timeout=IO_TIMEOUT_S)
