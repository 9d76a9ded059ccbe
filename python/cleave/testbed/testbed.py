"""`Testbed`: N emulated hosts, each a network namespace joined by a shaped veth pair to one
bridge in the root namespace, which also holds an address on it (docs/testbed.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import math
import subprocess
import time
from dataclasses import dataclass

from cleave.errors import UsageError
from cleave.testbed import cpu, exit_hooks, naming, resources, shaping, state, tcp
from cleave.testbed import racks as racks_module
from cleave.testbed.commands import TestbedError, ip, require_privileges
from cleave.testbed.owner import CLI, PROCESS, Owner

log = logging.getLogger(__name__)
RUN_TIMEOUT_S = 60.0  # default bound of Testbed.run
STOP_WAIT_S = 2.0  # per signal, for processes started with popen


@dataclass(frozen=True)
class Host:
    index: int
    name: str  # h0, h1, ...
    netns: str  # cleave-<slot>-h<index>, or its rack's cleave-<slot>-r<rack>
    address: str  # 198.18.x.(11+index)
    veth: str  # the host's interface (its NIC), inside netns
    bridge_port: str  # its peer on the bridge, in the root namespace
    rack: int | None = None  # with racks: which (hosts_per_rack consecutive hosts each)


def _check_positive(what: str, value: float, upper: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{what} must be a number, got {value!r}")
    if not (math.isfinite(value) and 0 < value <= upper):
        raise UsageError(f"{what} must be > 0 and <= {upper:g}, got {value!r}")
    return float(value)


class Testbed:
    """An emulated multi-host network on this machine. Use as a context manager, or call
    up() and down(). Owned by this process: removed when it exits (atexit, SIGTERM, SIGHUP),
    and by the next up() anywhere if it was killed. ``detached=True`` (what `cleave testbed
    up` uses) makes it owned by nobody: it stays until removed by name."""

    __test__ = False  # not a pytest test class despite the name

    def __init__(
        self,
        hosts: int,
        link_gbit: float = 1.0,
        *,
        burst_kb: float = shaping.DEFAULT_BURST_KB,
        queue_kb: float = shaping.DEFAULT_QUEUE_KB,
        name: str | None = None,
        detached: bool = False,
        racks: int | None = None,
        mode: str = "tor",
        rack_gbit: list[float] | None = None,
        host_gbit: list[float | None] | None = None,
        cpu_cores: list[float | None] | None = None,
        rto_min_ms: float = tcp.DEFAULT_RTO_MIN_MS,
    ):
        if isinstance(hosts, bool) or not isinstance(hosts, int):
            raise UsageError(f"hosts must be an integer, got {hosts!r}")
        if not 1 <= hosts <= naming.MAX_HOSTS:
            raise UsageError(f"hosts must be 1..{naming.MAX_HOSTS}, got {hosts}")
        if name is not None and not naming.NAME_RE.match(name):
            raise UsageError(
                f"name must be 1-32 characters of letters, digits, '_', '.', '-' starting with "
                f"a letter or digit, got {name!r}"
            )
        self.shape = shaping.Shape(
            gbit=_check_positive("link_gbit", link_gbit, 100.0),
            burst_kb=_check_positive("burst_kb", burst_kb, 1024.0 * 1024),
            queue_kb=_check_positive("queue_kb", queue_kb, 1024.0 * 1024),
        )
        self.rto_min_ms = tcp.check(rto_min_ms)
        # Racks (racks.py): `hosts` split into `racks` racks of equal size, wired per `mode`.
        self.racks = racks
        self.mode = mode
        if racks is not None:
            if isinstance(racks, bool) or not isinstance(racks, int) or racks < 1:
                raise UsageError(f"racks must be an integer >= 1, got {racks!r}")
            if hosts % racks:
                raise UsageError(f"hosts ({hosts}) must be a multiple of racks ({racks})")
            racks_module.check(racks, hosts // racks, mode, naming.MAX_HOSTS)
        # Each rack's NIC rate, where racks differ (a bench's client rack, say); else link_gbit.
        self.rack_gbit = None
        if rack_gbit is not None:
            if racks is None or len(rack_gbit) != racks:
                raise UsageError(f"rack_gbit must give one rate per rack, got {rack_gbit!r}")
            self.rack_gbit = [_check_positive("rack_gbit", g, 100.0) for g in rack_gbit]
        # Per host (None: the default): its own link rate, its CPU cap in cores (cpu.py).
        self.host_gbit = _per_host("host_gbit", host_gbit, hosts)
        self.cpu_cores = _per_host("cpu_cores", cpu_cores, hosts)
        for i, g in enumerate(self.host_gbit):
            if g is not None:
                _check_positive(f"host_gbit[{i}]", g, 100.0)
        for i, c in enumerate(self.cpu_cores):
            if c is not None:
                cpu.check_cores(c, f"cpu_cores[{i}]")
        self._cpu_procs: dict[int, object] = {}  # host index -> its cgroup's procs file
        self.host_count = hosts
        self.requested_name = name
        self.detached = detached
        self._slot: int | None = None
        self._name: str | None = None
        self._hosts: list[Host] = []
        self._procs: list[subprocess.Popen] = []

    # -- lifecycle -------------------------------------------------------------------------

    def up(self) -> Testbed:
        """Create the namespaces, veths, bridge and qdiscs. Removes leftovers of dead owners
        first. On any failure everything made so far is removed and the error re-raised."""
        if self._slot is not None:
            raise UsageError(f"testbed {self._name!r} is already up")
        require_privileges()
        owner = Owner.current(CLI if self.detached else PROCESS)
        with state.locked():
            resources.reclaim_dead()
            inst = self._claim(owner)
        self._slot, self._name = inst.slot, inst.name
        if not self.detached:
            exit_hooks.register(id(self), self.down)
        try:
            self._build(owner)
        except BaseException as err:
            try:
                self.down()
            except Exception as cleanup_err:  # report both; the next up() retries the removal
                log.error("removing the partial testbed after %r failed: %s", err, cleanup_err)
            raise
        return self

    def _claim(self, owner: Owner) -> state.InstanceState:
        """Pick a free slot and record it (the caller holds the lock): its state file exists
        before anything of it exists in the kernel."""
        states, broken = state.read_all()
        names = {s.name: s for s in states.values()}
        if self.requested_name in names:
            other = names[self.requested_name]
            raise UsageError(
                f"testbed name {self.requested_name!r} is in use by slot {other.slot} "
                f"(owner {other.owner.describe()}); pick another --name or remove it with "
                f"`cleave testbed down --name {self.requested_name}`"
            )
        busy = set(states) | set(broken) | resources.slots_present()
        routed = resources.routed_networks()
        for slot in range(naming.SLOTS):
            subnet = naming.Names(slot).subnet
            if slot in busy or any(net.overlaps(subnet) for net in routed):
                continue
            name = self.requested_name or f"tb{slot}"
            if name in names:  # someone chose our default name for theirs
                name = f"tb{slot}-{owner.pid}"
            inst = state.InstanceState(
                slot=slot,
                name=name,
                hosts=self.host_count,
                link_gbit=self.shape.gbit,
                burst_kb=self.shape.burst_kb,
                queue_kb=self.shape.queue_kb,
                owner=owner,
                created=time.time(),
                racks=self.racks or 0,
                rack_mode=self.mode if self.racks else "",
            )
            state.write(inst)
            return inst
        raise TestbedError(
            f"no free /24 left in {naming.RANGE}: {len(busy)} slots hold testbeds and "
            f"others overlap existing routes; remove some with `cleave testbed down --all`"
        )

    def _build(self, owner: Owner) -> None:
        assert self._slot is not None
        n = naming.Names(self._slot)
        prefix = n.subnet.prefixlen
        # nf_call_* 0: the host firewall (br_netfilter) must not filter traffic between hosts.
        ip(
            "link",
            "add",
            "name",
            n.bridge,
            "type",
            "bridge",
            "stp_state",
            "0",
            "nf_call_iptables",
            "0",
            "nf_call_ip6tables",
            "0",
            "nf_call_arptables",
            "0",
        )
        ip("link", "set", "dev", n.bridge, "alias", owner.alias())
        ip("addr", "add", f"{n.root_address}/{prefix}", "dev", n.bridge)
        ip("link", "set", "dev", n.bridge, "up")
        tcp.apply_route(str(n.subnet), n.bridge, n.root_address, self.rto_min_ms)
        netns_floor = tcp.netns_floor(self.rto_min_ms)
        per_rack = self.host_count // self.racks if self.racks else 0
        for r in range(self.racks or 0):
            ip("netns", "add", n.rack_netns(r))
            ip("-n", n.rack_netns(r), "link", "set", "dev", "lo", "up")
            racks_module.sysctls(n.rack_netns(r))
            tcp.apply_netns(n.rack_netns(r), netns_floor)
        for i in range(self.host_count):
            rack = i // per_rack if per_rack else None
            host = Host(
                index=i,
                name=f"h{i}",
                netns=n.netns(i) if rack is None else n.rack_netns(rack),
                address=n.host_address(i),
                veth=n.host_veth(i),
                bridge_port=n.bridge_veth(i),
                rack=rack,
            )
            if rack is None:
                ip("netns", "add", host.netns)
                tcp.apply_netns(host.netns, netns_floor)
            ip(
                "link",
                "add",
                host.bridge_port,
                "type",
                "veth",
                "peer",
                "name",
                host.veth,
                "netns",
                host.netns,
            )
            ip("link", "set", "dev", host.bridge_port, "master", n.bridge, "up")
            if rack is None:
                ip("-n", host.netns, "link", "set", "dev", "lo", "up")
            ip("-n", host.netns, "addr", "add", f"{host.address}/{prefix}", "dev", host.veth)
            ip("-n", host.netns, "link", "set", "dev", host.veth, "up")
            if self.cpu_cores[i] is not None:
                self._cpu_procs[i] = cpu.create(self._slot, i, self.cpu_cores[i])
            shape = self.shape_of(host)
            shaping.apply(host.veth, shape, netns=host.netns)  # host -> bridge
            shaping.apply(host.bridge_port, shape)  # bridge -> host
            self._hosts.append(host)
        for r in range(self.racks or 0):
            self._wire_rack(r, prefix)

    def _wire_rack(self, rack: int, prefix: int) -> None:
        netns = naming.Names(self._require_up()).rack_netns(rack)
        nics = [(h.veth, h.address) for h in self._hosts if h.rack == rack]
        if self.mode == "tor":
            racks_module.wire_tor(netns, nics, prefix, self.subnet)
            return
        racks_module.wire_pool(netns, nics, self._peers(rack))

    def _peers(self, rack: int) -> list[tuple[str, list[str]]]:
        """Each NIC address of the other racks, with its rack's NIC addresses in order."""
        of_rack = {
            r: [h.address for h in self._hosts if h.rack == r] for r in range(self.racks or 0)
        }
        return [(h.address, of_rack[h.rack]) for h in self._hosts if h.rack not in (None, rack)]

    def shape_of(self, host: Host) -> shaping.Shape:
        """The shaping of ``host``'s link: its own rate where given, else its rack's where
        racks have their own."""
        if self.host_gbit[host.index] is not None:
            return dataclasses.replace(self.shape, gbit=self.host_gbit[host.index])
        if self.rack_gbit is None or host.rack is None:
            return self.shape
        return dataclasses.replace(self.shape, gbit=self.rack_gbit[host.rack])

    def rack_hosts(self, rack: int) -> list[Host]:
        """The hosts of ``rack``, in order (their NICs are the rack's)."""
        return [h for h in self.hosts if h.rack == rack]

    def down(self) -> None:
        """Stop processes started in the hosts and remove everything this testbed made.
        Idempotent. If removal fails the state file stays, so a later up() retries it."""
        if self._slot is None:
            return
        self._stop_procs()
        resources.remove_slot(self._slot)
        state.remove(self._slot)
        exit_hooks.unregister(id(self))
        self._slot = None
        self._hosts = []
        self._cpu_procs = {}

    def __enter__(self) -> Testbed:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def _stop_procs(self) -> None:
        procs, self._procs = self._procs, []
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=STOP_WAIT_S)

    # -- what it is ------------------------------------------------------------------------

    def _require_up(self) -> int:
        if self._slot is None:
            raise UsageError("the testbed is not up: call up() or use it as a context manager")
        return self._slot

    @property
    def slot(self) -> int:
        """The instance id: selects the subnet and appears in every name."""
        return self._require_up()

    @property
    def name(self) -> str:
        self._require_up()
        assert self._name is not None
        return self._name

    @property
    def hosts(self) -> list[Host]:
        self._require_up()
        return list(self._hosts)

    @property
    def root_address(self) -> str:
        """The root namespace's address on the bridge: tests and clients there use it."""
        return naming.Names(self._require_up()).root_address

    @property
    def subnet(self) -> str:
        return str(naming.Names(self._require_up()).subnet)

    def __repr__(self) -> str:
        racked = f", racks={self.racks}, mode={self.mode}" if self.racks else ""
        if self._slot is None:
            return f"Testbed(hosts={self.host_count}, link_gbit={self.shape.gbit:g}{racked}, down)"
        return (
            f"Testbed({self._name!r}, slot={self._slot}, subnet={self.subnet}, "
            f"hosts={self.host_count}, link_gbit={self.shape.gbit:g}{racked})"
        )

    # -- using it --------------------------------------------------------------------------

    def host(self, which: Host | int | str) -> Host:
        """A host of this testbed by Host, index or name ("h0")."""
        hosts = self.hosts
        for h in hosts:
            if which == h or which == h.index or which == h.name:
                return h
        names = ", ".join(h.name for h in hosts)
        raise UsageError(f"no host {which!r} in testbed {self._name!r} (hosts: {names})")

    def exec_argv(self, host: Host | int | str, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run inside the host's namespace (and its CPU cap's cgroup)."""
        h = self.host(host)
        argv = ["ip", "netns", "exec", h.netns, *argv]
        procs = self._cpu_procs.get(h.index)
        # Joined before `ip netns exec`, which mounts a sysfs of the namespace's own over
        # /sys (no cgroup files inside); the cgroup is kept across exec and netns.
        return argv if procs is None else cpu.joined(procs, argv)

    def popen(self, host: Host | int | str, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside the host. down() stops it if it is still running."""
        proc = subprocess.Popen(self.exec_argv(host, argv), **kw)
        self._procs.append(proc)
        return proc

    def run(self, host: Host | int | str, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """subprocess.run inside the host; bounded by RUN_TIMEOUT_S unless ``timeout`` given."""
        kw.setdefault("timeout", RUN_TIMEOUT_S)
        return subprocess.run(self.exec_argv(host, argv), **kw)

    def prioritize_port(self, port: int) -> None:
        """Traffic to or from TCP/UDP ``port`` goes in a higher-priority htb class on every host
        link, both directions (docs/testbed.md, "Priority for control traffic"): what
        RDMA QoS does for a control channel."""
        for h in self.hosts:
            shaping.add_priority_port(h.veth, self.shape_of(h), port, netns=h.netns)
            shaping.add_priority_port(h.bridge_port, self.shape_of(h), port)

    def prioritize_dscp(self, dscp: int) -> None:
        """IPv4 packets marked ``dscp`` go in the higher-priority htb class on every host link,
        both directions: every Cleave control connection marks its packets (DSCP EF,
        docs/protocol.md "Priority of control traffic"), as a network with QoS would honour."""
        for h in self.hosts:
            shaping.add_priority_dscp(h.veth, self.shape_of(h), dscp, netns=h.netns)
            shaping.add_priority_dscp(h.bridge_port, self.shape_of(h), dscp)

    def set_link(self, host: Host | int | str, up: bool) -> None:
        """Take the host's link down (both veth ends) or bring it back; its address, routes
        and shaping survive."""
        h = self.host(host)
        set_link(h.netns, h.veth, h.bridge_port, up)
        if up and h.rack is not None:
            self._restore_routes(h)

    def _restore_routes(self, nic: Host) -> None:
        """A NIC's link up again: its routes back (the kernel dropped them when it went down)."""
        per_rack = self.host_count // (self.racks or 1)
        k = nic.index % per_rack
        if self.mode == "tor":
            racks_module.tor_routes(nic.netns, k, nic.veth, nic.address, self.subnet)
            return
        racks_module.pool_routes(nic.netns, k, nic.veth, nic.address, self._peers(nic.rack))


def _per_host(what: str, values, hosts: int) -> list:
    if values is None:
        return [None] * hosts
    if len(values) != hosts:
        raise UsageError(f"{what} must give one value (or None) per host, got {values!r}")
    return list(values)


def set_link(netns: str, veth: str, bridge_port: str, up: bool) -> None:
    """Both ends of one host link down or up (see Testbed.set_link, and `host_link` for a
    testbed another process made)."""
    where = "up" if up else "down"
    # Bridge side last going down and first coming up, so the host side flaps cleanly.
    steps = [
        ["-n", netns, "link", "set", "dev", veth, where],
        ["link", "set", "dev", bridge_port, where],
    ]
    for step in reversed(steps) if up else steps:
        ip(*step)


def host_link(address: str) -> tuple[str, str, str]:
    """(netns, veth, bridge port) of the emulated host at ``address``, in whichever testbed
    holds it (one another process made, say `cleave serve --runner testbed`)."""
    slot = naming.slot_of_address(address)
    index = None
    if slot is not None:
        n = naming.Names(slot)
        offset = int(ipaddress.ip_address(address)) - int(ipaddress.ip_address(n.host_address(0)))
        index = offset if 0 <= offset < naming.MAX_HOSTS else None
    if slot is None or index is None:
        raise UsageError(f"{address!r} is no testbed host address (expected one in {naming.RANGE})")
    n = naming.Names(slot)
    netns = n.netns(index)
    names = resources.netns_names()
    if netns not in names:  # a racked testbed: the host's NIC is in its rack's namespace
        racks = [ns for ns in names if ns.startswith(f"{naming.NETNS_PREFIX}{slot}-r")]
        netns = next(
            (
                ns
                for ns in racks
                if ip("-n", ns, "link", "show", "dev", n.host_veth(index), check=False)
            ),
            netns,
        )
    return netns, n.host_veth(index), n.bridge_veth(index)
