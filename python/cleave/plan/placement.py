"""Topology-aware placement, after Prism's Algorithm 1 (docs/plan.md, "Topology-aware
placement"): every instance of the model in one pod; each new instance to the access switch
that already holds most of them; a ranker's GPU and its NIC under one PCIe switch; a router's
or shard's cores under its NIC's PCIe switch; density limits and resource requests kept;
replicas of a range group on distinct hosts, and on distinct switches where the pod allows.
Each choice is explained, and the result's cost (cross-switch pairs, stranded resources)
measured."""

from __future__ import annotations

from dataclasses import dataclass, field

from cleave.errors import UsageError
from cleave.plan.topology import HostView, Pcie, Topology

ROLES = ("rankers", "shards", "routers")  # placement order: the scarce GPU hosts first
SCORES = {2: "under one PCIe switch", 1: "on one NUMA node", 0: "across NUMA nodes"}


@dataclass
class Request:
    """What one role instance needs."""

    name: str
    role: str  # shards | rankers | routers
    cpus: int
    memory_gib: float
    gpus: int = 0
    group: int | None = None  # a shard's range group: its replicas spread


@dataclass
class Choice:
    request: Request
    host: str
    switch: str
    pod: str
    score: int  # 2: device/cores and NIC under one PCIe switch; 1: one NUMA node; 0: neither
    cores: dict[str, int]  # PCIe switch -> cores taken under it
    gpu_pcie: str = ""
    nic_pcie: str = ""
    why: str = ""


@dataclass
class Placement:
    choices: list[Choice]
    cross_switch_pairs: int
    pairs: int
    stranded_gpus: int
    stranded_cpus: int
    report: list[str] = field(default_factory=list)
    _by_name: dict[str, Choice] = field(default_factory=dict, repr=False)

    def choice(self, name: str) -> Choice:
        if len(self._by_name) != len(self.choices):
            self._by_name = {c.request.name: c for c in self.choices}
        return self._by_name[name]

    def host_of(self, name: str) -> str:
        return self.choice(name).host


class _HostState:
    def __init__(self, view: HostView):
        self.view = view
        self.mem = view.host.memory_gib
        self.gpus = {p.name: p.gpus for p in view.pcie}
        self.cpus = {p.name: p.cpus for p in view.pcie}
        self.count = {r: 0 for r in ROLES}
        self.groups: set[int] = set()

    def free_cpus(self) -> int:
        return sum(self.cpus.values())

    def free_gpus(self) -> int:
        return sum(self.gpus.values())

    def _take_cores(self, first: list[Pcie], n: int) -> dict[str, int] | None:
        """`n` cores, from the PCIe switches in `first` before the others."""
        order = first + [p for p in self.view.pcie if p not in first]
        taken: dict[str, int] = {}
        for p in order:
            k = min(self.cpus[p.name], n - sum(taken.values()))
            if k > 0:
                taken[p.name] = k
        return taken if sum(taken.values()) == n else None

    def calc(self, req: Request) -> Choice | None:
        """Algorithm 1's calc: the best binding of this request on this host, or None."""
        if req.memory_gib > self.mem or req.cpus > self.free_cpus() or req.gpus > self.free_gpus():
            return None
        nics = [p for p in self.view.pcie if p.nics]
        best = None
        anchors = [p for p in self.view.pcie if self.gpus[p.name] >= req.gpus] if req.gpus else nics
        if req.gpus and not anchors:
            return None  # a ranker's GPUs under one PCIe switch, never split
        for anchor in anchors or self.view.pcie:
            near = [p for p in self.view.pcie if p.numa and p.numa == anchor.numa]
            nic = anchor if anchor.nics else next((p for p in near if p.nics), None)
            nic = nic or (nics[0] if nics else None)
            local = [anchor] + [p for p in near if p is not anchor]
            cores = self._take_cores(local, req.cpus)
            if cores is None:
                continue
            if req.gpus:  # HN: the GPU's path to its NIC
                score = 2 if anchor.nics else (1 if nic in near else 0)
            else:  # CN: its cores' path to the NIC
                on_numa = {p.name for p in local}
                score = 2 if set(cores) <= {anchor.name} and anchor.nics else 0
                if not score and nic is not None and set(cores) <= on_numa and nic.name in on_numa:
                    score = 1
            if best is None or score > best.score:
                best = Choice(
                    req,
                    self.view.host.name,
                    self.view.switch,
                    self.view.pod,
                    score,
                    cores,
                    anchor.name if req.gpus else "",
                    nic.name if nic else "",
                )
        return best

    def apply(self, choice: Choice) -> None:
        req = choice.request
        self.mem -= req.memory_gib
        for p, k in choice.cores.items():
            self.cpus[p] -= k
        if req.gpus:
            self.gpus[choice.gpu_pcie] -= req.gpus
        self.count[req.role] += 1
        if req.group is not None:
            self.groups.add(req.group)


def _largest(topology: Topology) -> str:
    h = max(topology.hosts.values(), key=lambda v: (v.host.cpus, v.host.memory_gib, v.host.gpus))
    return f"{h.host.name}: {h.host.cpus} cpus, {h.host.memory_gib} GiB, {h.host.gpus} gpus"


def _fits_alone(req: Request, topology: Topology) -> bool:
    return any(
        req.cpus <= v.host.cpus and req.memory_gib <= v.host.memory_gib and req.gpus <= v.host.gpus
        for v in topology.hosts.values()
    )


def _try_pod(pod: str, requests: list[Request], topology: Topology, limits: dict[str, int]):
    states = {n: _HostState(v) for n, v in topology.hosts.items() if v.pod == pod}
    switches = topology.switches(pod)
    on_switch = dict.fromkeys(switches, 0)
    groups_on_switch: dict[str, set[int]] = {s: set() for s in switches}
    choices, failed = [], []
    for req in requests:
        # Algorithm 1 line 3: switches holding most of the model's instances first; a replica
        # avoids switches that hold its group while another switch can take it.
        order = sorted(
            switches,
            key=lambda s: (
                req.group is not None and req.group in groups_on_switch[s],
                -on_switch[s],
                -sum(st.free_cpus() for st in states.values() if st.view.switch == s),
            ),
        )
        chosen = None
        for s in order:
            candidates = []
            for st in states.values():
                if st.view.switch != s:
                    continue
                if req.group is not None and req.group in st.groups:
                    continue  # a range group's replicas on distinct hosts
                if limits.get(req.role) and st.count[req.role] >= limits[req.role]:
                    continue
                c = st.calc(req)
                if c is not None:
                    # Best topology score; then CN roles keep off hosts with free GPUs; then
                    # the host with the fewest of this role (a role's instances spread over
                    # hosts: losing one loses fewer); then the host they fill most.
                    spare_gpus = 0 if req.gpus else st.free_gpus()
                    key = (-c.score, spare_gpus, st.count[req.role], st.free_cpus() - req.cpus)
                    candidates.append((key, c))
            if candidates:
                chosen = min(candidates, key=lambda x: x[0])[1]
                break
        if chosen is None:
            failed.append(req)
            continue
        held = on_switch[chosen.switch]
        states[chosen.host].apply(chosen)
        on_switch[chosen.switch] += 1
        if req.group is not None:
            groups_on_switch[chosen.switch].add(req.group)
        where = "it held none yet" if not held else f"it held {held} of the model's instances"
        chosen.why = f"switch {chosen.switch} ({where}); {_binding(chosen)}"
        choices.append(chosen)
    return choices, failed, states


def _binding(c: Choice) -> str:
    cores = ", ".join(f"{k} on {p}" for p, k in c.cores.items())
    if c.request.gpus:
        return f"GPU on {c.gpu_pcie}, NIC on {c.nic_pcie} ({SCORES[c.score]}); cores {cores}"
    return f"cores {cores}; NIC on {c.nic_pcie or 'none'} ({SCORES[c.score]})"


def place(requests: list[Request], topology: Topology, limits: dict[str, int] | None = None):
    """A Placement of every request in one pod, or a UsageError naming what does not fit."""
    limits = limits or {}
    too_big = [r for r in requests if not _fits_alone(r, topology)]
    if too_big:
        r = too_big[0]
        raise UsageError(
            f"{r.name}: requests {r.cpus} cpus, {r.memory_gib:.3f} GiB, {r.gpus} gpus: larger "
            f"than every host (the largest is {_largest(topology)})"
            + (f"; and {len(too_big) - 1} more like it" if len(too_big) > 1 else "")
        )
    ordered = sorted(requests, key=lambda r: ROLES.index(r.role))
    best = None
    for pod in topology.pods:
        choices, failed, states = _try_pod(pod, ordered, topology, limits)
        if not failed:
            return _finish(pod, choices, states, topology)
        if best is None or len(failed) < len(best[1]):
            best = (pod, failed)
    pod, failed = best
    names = ", ".join(r.name for r in failed[:5]) + (" ..." if len(failed) > 5 else "")
    limit = ", ".join(f"{k} {v}" for k, v in limits.items())
    raise UsageError(
        f"topology: no pod holds every instance of the model (all must share one pod); the "
        f"closest, {pod}, leaves {len(failed)} unplaced: {names}"
        + (f" (max_instance_per_node: {limit})" if limit else "")
        + "; add hosts to a pod, or ask for fewer or smaller roles"
    )


def _finish(pod: str, choices: list[Choice], states: dict, topology: Topology) -> Placement:
    by_role = {r: [c for c in choices if c.request.role == r] for r in ROLES}
    # Traffic: every router talks to every ranker and to one replica of every range group
    # (the nearest: on its switch if one is there).
    pairs = cross = 0
    groups: dict[int, set[str]] = {}
    for c in by_role["shards"]:
        groups.setdefault(c.request.group, set()).add(c.switch)
    for router in by_role["routers"]:
        for ranker in by_role["rankers"]:
            pairs += 1
            cross += ranker.switch != router.switch
        for switches in groups.values():
            pairs += 1
            cross += router.switch not in switches
    # Stranded: free GPUs on used hosts where no ranker of this plan fits any more, free cores
    # on used hosts where no role of this plan fits.
    used = {c.host for c in choices}
    requests = [c.request for c in choices]
    rankers = [r for r in requests if r.gpus]
    stranded_gpus = stranded_cpus = 0
    for name in used:
        st = states[name]
        if st.free_gpus() and not any(st.calc(r) for r in rankers):
            stranded_gpus += st.free_gpus()
        if st.free_cpus() and not any(st.calc(r) for r in requests):
            stranded_cpus += st.free_cpus()
    report = [
        f"placement: pod {pod} (every instance of the model in one pod); "
        f"{len(topology.switches(pod))} switches, "
        f"{sum(v.pod == pod for v in topology.hosts.values())} hosts in it",
        *(f"{c.request.name} -> {c.host}: {c.why}" for c in choices),
        f"cost: {cross} of {pairs} router-ranker and router-range-group pairs cross a switch; "
        f"stranded on the hosts used: {stranded_gpus} GPUs, {stranded_cpus} cores",
    ]
    return Placement(choices, cross, pairs, stranded_gpus, stranded_cpus, report)
