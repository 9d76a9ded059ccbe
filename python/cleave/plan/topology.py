"""A cluster's topology (docs/plan.md, "Topology-aware placement"): pods hold access switches,
switches hold hosts, and inside a host NUMA nodes hold PCIe switches with GPUs, NICs and the
cores local to them. Written in the cluster file as a flat list of nodes, each naming its
parent; resolved here into per-host views, every problem (unknown parent, cycle, wrong kind,
more GPUs than the host has) named by its field."""

from __future__ import annotations

from dataclasses import dataclass, field

from cleave.errors import UsageError
from cleave.plan.schema import Host

# Each kind's parent kind; a PCIe switch may hang off a NUMA node or the host itself.
PARENTS = {"pod": (), "switch": ("pod",), "host": ("switch",), "numa": ("host",)}
PARENTS["pcie"] = ("numa", "host")
KINDS = tuple(PARENTS)


@dataclass
class Node:
    """One entry of the cluster file's `topology:` list."""

    name: str
    kind: str  # pod | switch | host | numa | pcie
    parent: str = ""  # required except for pods
    gpus: int = 0  # pcie: GPUs under this PCIe switch
    nics: int = 0  # pcie: NICs under it
    cpus: int = 0  # pcie: cores local to it (on its NUMA node, nearest its devices)


@dataclass
class Pcie:
    """A PCIe switch of a host, or the host's rest: GPUs and cores no PCIe entry names."""

    name: str
    numa: str  # "" for the rest
    gpus: int
    nics: int
    cpus: int


@dataclass
class HostView:
    host: Host
    pod: str
    switch: str
    pcie: list[Pcie] = field(default_factory=list)


@dataclass
class Topology:
    hosts: dict[str, HostView]  # in the cluster file's host order
    pods: list[str]  # in file order

    def switches(self, pod: str) -> list[str]:
        seen: dict[str, None] = {}
        for view in self.hosts.values():
            if view.pod == pod:
                seen.setdefault(view.switch)
        return list(seen)


def build_topology(nodes: list[Node], hosts: list[Host], where: str = "topology") -> Topology:
    """Resolve `nodes` against the cluster's `hosts`; raise UsageError listing every problem."""
    problems: list[str] = []
    index: dict[str, int] = {}
    for i, n in enumerate(nodes):
        f = f"{where}[{i}]"
        if n.kind not in KINDS:
            problems.append(f"{f}.kind: expected one of {', '.join(KINDS)}, got {n.kind!r}")
        if not n.name:
            problems.append(f"{f}.name: expected a name, got an empty string")
        elif n.name in index:
            problems.append(f"{f}.name: {n.name!r} is already {where}[{index[n.name]}]")
        index.setdefault(n.name, i)
        for key in ("gpus", "nics", "cpus"):
            if getattr(n, key) < 0:
                problems.append(f"{f}.{key}: expected >= 0, got {getattr(n, key)}")
            elif getattr(n, key) and n.kind != "pcie":
                problems.append(f"{f}.{key}: only a pcie node holds devices, got {n.kind!r}")
    if problems:
        raise UsageError("; ".join(problems))
    for i, n in enumerate(nodes):
        f = f"{where}[{i}]"
        if n.kind == "pod":
            if n.parent:
                problems.append(f"{f}.parent: a pod has no parent, got {n.parent!r}")
            continue
        if not n.parent:
            problems.append(f"{f}.parent: expected the {'/'.join(PARENTS[n.kind])} it is in")
        elif n.parent not in index:
            problems.append(f"{f}.parent: unknown node {n.parent!r}; expected a name listed here")
    if problems:
        raise UsageError("; ".join(problems))
    for i, n in enumerate(nodes):  # before kinds: a loop is named as one
        chain, at = [n.name], n
        for _ in range(len(nodes)):
            if not at.parent:
                break
            at = nodes[index[at.parent]]
            if at.name in chain:
                loop = " -> ".join([*chain[chain.index(at.name) :], at.name])
                raise UsageError(f"{where}[{i}].parent: the parents form a cycle: {loop}")
            chain.append(at.name)
    for i, n in enumerate(nodes):
        parent = nodes[index[n.parent]] if n.parent else None
        if parent is not None and parent.kind not in PARENTS[n.kind]:
            problems.append(
                f"{where}[{i}].parent: a {n.kind} belongs in a {' or '.join(PARENTS[n.kind])}, "
                f"but {n.parent!r} is a {parent.kind}"
            )
    if problems:
        raise UsageError("; ".join(problems))
    by_name = {h.name: h for h in hosts}
    views: dict[str, HostView] = {}
    for i, n in enumerate(nodes):
        if n.kind != "host":
            continue
        if n.name not in by_name:
            problems.append(
                f"{where}[{i}].name: host {n.name!r} is not in the cluster's hosts "
                f"({', '.join(by_name)})"
            )
            continue
        switch = nodes[index[n.parent]]
        views[n.name] = HostView(by_name[n.name], switch.parent, switch.name)
    for i, h in enumerate(hosts):
        if h.name not in views:
            problems.append(f"hosts[{i}]: host {h.name!r} is in no switch of the topology")
    if problems:
        raise UsageError("; ".join(problems))
    for n in nodes:
        if n.kind != "pcie":
            continue
        parent = nodes[index[n.parent]]
        host = parent.name if parent.kind == "host" else parent.parent
        numa = parent.name if parent.kind == "numa" else ""
        views[host].pcie.append(Pcie(n.name, numa, n.gpus, n.nics, n.cpus))
    for name, view in views.items():
        h = view.host
        gpus = sum(p.gpus for p in view.pcie)
        cpus = sum(p.cpus for p in view.pcie)
        if gpus > h.gpus or cpus > h.cpus:
            problems.append(
                f"host {name}: its PCIe switches hold {gpus} GPUs and {cpus} cores; expected at "
                f"most the host's gpus ({h.gpus}) and cpus ({h.cpus})"
            )
        # The rest: devices and cores no PCIe entry names. A host without any PCIe entry is one
        # implicit switch with one NIC, so a plain host list still places.
        nics = 0 if view.pcie else 1
        if h.gpus - gpus or h.cpus - cpus or not view.pcie:
            view.pcie.append(Pcie(f"{name}/rest", "", h.gpus - gpus, nics, h.cpus - cpus))
    if problems:
        raise UsageError("; ".join(problems))
    pods = [n.name for n in nodes if n.kind == "pod"]
    order = [h.name for h in hosts]
    return Topology({n: views[n] for n in order}, pods)


def generated(
    hosts: list[Host], hosts_per_switch: int = 32, switches_per_pod: int = 8
) -> list[Node]:
    """A two-tier topology for a plain host list, hosts in order: `hosts_per_switch` per access
    switch, `switches_per_pod` switches per pod; each GPU host gets one PCIe switch per pair of
    GPUs with one NIC, each CPU host one NIC (docs/plan.md). For examples and tests."""
    nodes: list[Node] = []
    per_pod = hosts_per_switch * switches_per_pod
    for i, h in enumerate(hosts):
        pod, switch = f"pod{i // per_pod}", f"asw{i // hosts_per_switch}"
        if i % per_pod == 0:
            nodes.append(Node(pod, "pod"))
        if i % hosts_per_switch == 0:
            nodes.append(Node(switch, "switch", pod))
        nodes.append(Node(h.name, "host", switch))
        numa = [f"{h.name}-numa0", f"{h.name}-numa1"]
        nodes += [Node(n, "numa", h.name) for n in numa]
        groups = max(1, (h.gpus + 1) // 2)
        for g in range(groups):
            gpus = min(2, h.gpus - 2 * g) if h.gpus else 0
            cpus = h.cpus // groups if g < groups - 1 else h.cpus - (h.cpus // groups) * g
            nodes.append(Node(f"{h.name}-pcie{g}", "pcie", numa[g * 2 // groups], gpus, 1, cpus))
    return nodes
