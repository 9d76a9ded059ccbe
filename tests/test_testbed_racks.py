"""Racks on the testbed (docs/testbed.md, "Racks") and `transport: mptcp`: a bulk MPTCP
transfer between two racks leaves by one NIC in ToR mode and by every NIC of the rack in pool
mode (per-NIC byte counters); a plan served with `transport: mptcp` on pool-mode racks answers
bit for bit what the same plan answers over TCP; and one NIC of the shard rack taken down
under load with 1 s budgets fails no request while its traffic moves to the other NIC."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from cleave.bench.loadgen import outputs_of
from cleave.launch.process import ServeProcess
from cleave.plan import emulated_hosts, make_plan, save_plan
from cleave.settings import RankerConfig, ServeConfig
from cleave.testbed import commands, instances
from cleave.testbed.testbed import Testbed, host_link, set_link
from support.served import TOLERANCE, Served, infer_url
from support.testbed import host_addresses
from support.waiting import wait_for

pytestmark = [
    pytest.mark.testbed,
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
    pytest.mark.skipif(commands.unavailable() is not None, reason=commands.unavailable() or ""),
]

MB = 1 << 20
BUDGET_MS = 1000


def _tx(tb: Testbed, dev: str) -> int:
    host = next(h for h in tb.hosts if h.veth == dev)
    proc = tb.run(
        host,
        ["cat", f"/sys/class/net/{dev}/statistics/tx_bytes"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(proc.stdout)


SENDER = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_MPTCP)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5001)); s.listen(); print("listening", flush=True)
c, _ = s.accept()
chunk = b"x" * 65536
for _ in range(int(sys.argv[2]) // 65536):
    c.sendall(chunk)
c.close()
"""

RECEIVER = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_MPTCP)
s.connect((sys.argv[1], 5001))
n = 0
while (b := s.recv(1 << 20)):
    n += len(b)
print(n, s.getsockopt(socket.IPPROTO_TCP, 43))  # TCP_IS_MPTCP
"""


@pytest.mark.parametrize("mode", ["tor", "pool"])
def test_a_bulk_transfer_leaves_by_one_nic_or_by_every_nic_of_the_rack(mode):
    nbytes = 16 * MB
    # 0.1 Gbit/s: slow enough that even a starved sender fills every link it is given.
    with Testbed(8, 0.1, racks=2, mode=mode) as tb:
        # Its state file records the racks: `cleave testbed list` says them.
        (row,) = [r for r in instances.list_all() if r.name == tb.name]
        assert row.hosts == f"8 (2 racks, {mode})"
        sender, receiver = tb.host(5), tb.host(0)  # rack 1's second host, rack 0's first
        nics = [h.veth for h in tb.rack_hosts(1)]
        server = tb.popen(
            sender,
            [sys.executable, "-c", SENDER, sender.address, str(nbytes)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout.readline().strip() == "listening"
        before = {d: _tx(tb, d) for d in nics}
        got = tb.run(
            receiver,
            [sys.executable, "-c", RECEIVER, sender.address],
            capture_output=True,
            text=True,
            check=True,
        )
        assert server.wait(30) == 0
        received, is_mptcp = map(int, got.stdout.split())
        assert received == nbytes
        assert is_mptcp == 1
        sent = {d: _tx(tb, d) - before[d] for d in nics}
        total = sum(sent.values())
        assert total >= nbytes, sent
        if mode == "tor":  # only the sender's own NIC
            assert sent[sender.veth] >= 0.99 * total, sent
        else:  # every NIC of the rack carries a real share
            assert all(b >= 0.1 * total for b in sent.values()), sent


def racked_plan(served: Served, root, transport: str):
    """Router h0 and ranker h1 in rack 0, each range on both shard hosts h2 and h3 of rack 1
    (2 racks x 2 hosts): every lookup crosses the racks' NICs."""
    config = ServeConfig(ranker=RankerConfig(threads=1, device="cpu"))
    plan = make_plan(served.dir, emulated_hosts(4), 2, 2, 1, 1, serve_config=config)
    moved = {"h1": "h2", "h2": "h3", "h3": "h1"}  # make_plan: router h0, shards h1 h2, ranker h3
    for role in [*plan.shards, *plan.rankers]:
        role.host = moved[role.host]
    plan.transport = transport
    return save_plan(plan, root / f"{served.name}-{transport}.yaml")


def post_budget(url: str, body: bytes, sheds: int = 5) -> tuple[int, dict]:
    """POST with a 1 s budget; no answer within 30 s is a hang (status 0). A request the
    router's admission sheds (503, `Retry-After`) is sent again after that wait, at most
    `sheds` times, as clients of a shedding server do: admission is not what this checks."""
    for _ in range(sheds + 1):
        request = urllib.request.Request(
            url,
            data=body,
            headers={"Content-Type": "application/json", "cleave-budget-ms": str(BUDGET_MS)},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            text = err.read().decode(errors="replace")
            if err.code != 503 or '"stage":"admission"' not in text:
                return err.code, {"error": text}
            time.sleep(float(err.headers.get("Retry-After", "1")))
        except OSError as err:
            return 0, {"error": f"no answer: {err}"}
    return 503, {"error": f"shed {sheds + 1} times by admission"}


def exact_outputs(url: str, bodies) -> list[list[np.ndarray]]:
    out = []
    for body, _ in bodies:
        status, reply = post_budget(url, body)
        assert status == 200, reply
        out.append(outputs_of(reply))
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    return Served("dlrm", tmp_path_factory.mktemp("bundles"))


def test_mptcp_on_pool_racks_scores_bit_for_bit_and_survives_a_nic_down(served, tmp_path):
    bodies = [served.request(b) for b in (1, 7, 64)]
    tcp = racked_plan(served, tmp_path, "tcp")
    with ServeProcess(None, "--plan", str(tcp)) as server:  # local runner, loopback TCP
        want = exact_outputs(infer_url(server, served), bodies)
        assert server.stop() == 0
    plan = racked_plan(served, tmp_path, "mptcp")
    flags = ("--runner", "testbed", "--racks", "2", "--rack-mode", "pool", "--link-gbit", "0.5")
    with ServeProcess(None, "--plan", str(plan), *flags) as server:
        url = infer_url(server, served)
        got = exact_outputs(url, bodies)
        for g, w, (_, model) in zip(got, want, bodies, strict=True):
            assert all(np.array_equal(a, b) for a, b in zip(g, w, strict=True))
            assert all(np.abs(a - m).max() <= TOLERANCE for a, m in zip(g, model, strict=True))
        _nic_down_under_load(server, url, bodies)
        assert server.stop() == 0


def _port_rx(port: str) -> int:
    """Bytes a host NIC has sent: what its bridge port received (root namespace)."""
    with open(f"/sys/class/net/{port}/statistics/rx_bytes") as f:
        return int(f.read())


def _nic_down_under_load(server: ServeProcess, url: str, bodies) -> None:
    """Shard host h3's NIC down under load: its shard stays reachable through h2's NIC (the
    MPTCP subflow through the rack's other NIC), and no request fails."""
    addresses = host_addresses(server)
    _, _, h2_port = host_link(addresses["h2"])
    netns, veth, h3_port = host_link(addresses["h3"])
    results: list[tuple[int, dict]] = []
    stop = threading.Event()

    def load(worker: int) -> None:
        i = worker
        while not stop.is_set():  # bounded: stop is set below, each post by its timeout
            results.append(post_budget(url, bodies[i % 2][0]))  # batches of 1 and 7
            i += 1

    threads = [threading.Thread(target=load, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(results) > 10, "requests to flow", 30)
        set_link(netns, veth, h3_port, False)
        cut, h2_before, h3_before = len(results), _port_rx(h2_port), _port_rx(h3_port)
        wait_for(lambda: len(results) > cut + 30, "requests after the NIC went down", 60)
        h2_moved, h3_moved = _port_rx(h2_port) - h2_before, _port_rx(h3_port) - h3_before
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    failed = [(status, reply) for status, reply in results if status != 200]
    assert not failed, failed[:3]
    assert h3_moved == 0, h3_moved  # the NIC is down
    assert h2_moved > 0, h2_moved  # both shard hosts' replies left by the other NIC
    # The router's connections did run MPTCP with more than one subflow: the shard rack
    # took MP_JOINs (counters of the rack's namespace alone).
    assert mptcp_counter(netns, "MPJoinSynRx") > 0


def mptcp_counter(netns: str, name: str) -> int:
    """One MPTcpExt counter of a namespace (/proc/net/netstat: a line of names, then one
    of values)."""
    text = subprocess.run(
        ["ip", "netns", "exec", netns, "cat", "/proc/net/netstat"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    lines = [line.split() for line in text.splitlines() if line.startswith("MPTcpExt:")]
    return int(dict(zip(lines[0][1:], lines[1][1:], strict=True))[name])


def test_a_shard_on_a_kernel_that_refuses_mptcp_logs_and_serves_over_tcp(tmp_path):
    """`net.mptcp.enabled = 0` in the shard host's namespace: its `mptcp:` listener is plain
    TCP, said once on stderr, and an MPTCP client (the root namespace's) is answered."""
    from cleave import _native
    from cleave.bench.harness.bundles import Table, write_bundle
    from cleave.launch.supervisor import find_executable

    rows = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    bundle = write_bundle(tmp_path / "b", [Table("t", 8, 4)], lambda t, n: rows[:n], "test")
    with Testbed(1, 1.0) as tb:
        host = tb.host(0)
        tb.run(host, ["sysctl", "-qw", "net.mptcp.enabled=0"], check=True)
        address = f"mptcp:{host.address}:7000"
        argv = [find_executable("cleave-shard"), "--bundle", str(bundle), "--listen", address]
        shard = tb.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert shard.stdout.readline().startswith(f"ready {address}")
        client = _native.ShardClient([("t", 0, 8, address)], timeout_s=10)
        (got,) = client.lookup([("t", "gather", np.array([5, 1]), [])])
        assert np.array_equal(got, rows[[5, 1]])
        shard.terminate()
        _, err = shard.communicate(timeout=30)
    assert "the kernel refuses MPTCP sockets; transport mptcp falls back to TCP" in err
