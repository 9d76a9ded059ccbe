"""The cheapest mix of hosts for a rate at a p99 (docs/sizing.md, "The search").

A disaggregated deployment has three pools, each of one machine kind: routers, shards (range
groups of two replicas each, so losing a host loses no row) and rankers (one dtype, one thread
count). For every mix of kinds, dtype and thread count, each pool first gets the fewest hosts
that carry the rate within the CPU headroom, the NIC headroom and (shards) the memory; then,
while the predicted p99 is above the target, the host that buys the most latency per dollar
is added; last, each pool gets one host more than it needs (N+1: any one host may fail). The
cheapest mix wins; the next ones are the runners-up. Monolithic serving (every host holds all
tables and runs the whole model) is sized the same way, for the cost comparison."""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from cleave.errors import UsageError
from cleave.plan.check import GIB, SHARD_MARGIN_BYTES
from cleave.plan.planner import RANKER_MEMORY_GIB
from cleave.settings.schema import RankerConfig
from cleave.sizing import queueing
from cleave.sizing.capped import (
    MAX_WAIT_SCALE,
    MIN_WAIT_SCALE,
    ONE_PATH,
    calibration_pools,
    crossing,
    crossing_rate,
    default_dtype,
)
from cleave.sizing.catalog import MachineKind, testbed_cores

MEMORY_SHARE = 0.85  # of a host's memory for table rows; the rest for the OS and processes
RTT_MS = 0.05  # one hop's round trip inside a data center, beside the serialization delay
MAX_HOSTS = 256  # per pool, unless the catalog's max_count is lower
RANKER_MAX_BATCH = RankerConfig().max_batch  # rows; the plan's rankers keep the default
ROUTER_MEMORY_BYTES = 1 << 30  # a router's own memory: buffers of the requests in flight
# Router CPU per request when the profile has no measurement: a fixed part and a part per
# byte it moves (request in, lookups out and back, the ranker's payload out, reply back),
# the orders of magnitude of docs/benchmarks.md's router profile (binary tensors).
ROUTER_FIXED_US, ROUTER_NS_PER_BYTE = 150.0, 1.0
# A ranker option's "threads" when its dense program runs on a GPU (one ranker per GPU, its
# batches timed there by `cleave profile` on a GPU machine).
GPU = "cuda"


@dataclass(frozen=True)
class Target:
    rate: float  # requests per second
    p99_ms: float
    headroom: float = 0.7  # the most CPU or NIC utilization a pool is sized for


@dataclass
class Pool:
    name: str  # routers, shards, rankers, monolithic
    kind: MachineKind
    hosts: int
    servers_per_host: int  # processes x threads that each take one request at a time
    service_ms: float  # one request's (shards: one range group's lookup) time on one server
    # The same when the pool is saturated, where that differs (a capped host measured by
    # `cleave profile --capped`: a ranker joins queued requests); 0: service_ms. It sets the
    # pool's capacity, service_ms the latency a request sees.
    saturated_ms: float = 0.0
    wait_scale: float = 1.0  # the queueing wait's measured factor on such hosts (capped.py)
    arrivals_per_request: int = 1  # shards: one lookup per range group
    quantile: float = queueing.QUANTILE
    bytes_per_request: float = 0.0  # the most of in or out on a host's NIC, per request
    memory_bytes: float = 0.0  # table bytes over the whole pool (replicas included)
    memory_per_host: float = 0.0  # bytes every host holds whole (a router's cache)
    hit_rate: float = 0.0  # shards: the share of lookups the routers' caches answer
    batch_ms: float = 0.0  # a joined batch's time beyond one request's share of it
    binding: str = "rate"  # what set the host count
    extra: dict = field(default_factory=dict)

    def servers(self, hosts: int | None = None) -> int:
        return (self.hosts if hosts is None else hosts) * self.servers_per_host

    @property
    def capacity_ms(self) -> float:
        return self.saturated_ms or self.service_ms

    def p99_ms(self, rate: float, hosts: int | None = None) -> float:
        """The wait of a queue served at the pool's capacity, plus one request's own time.
        Each host is its own queue with its share of the arrivals: clients spread requests
        over the routers, and each router picks a ranker from what it alone has in flight,
        so no host takes over another's queue (on the testbed each of two routers sent all
        its requests to one of two rankers)."""
        hosts = self.hosts if hosts is None else hosts
        arrivals = rate * self.arrivals_per_request / hosts
        s = self.capacity_ms / 1e3
        wait = queueing.p99_s(self.servers_per_host, s, arrivals, self.quantile) - s
        return wait * 1e3 * self.wait_scale + self.service_ms + self.batch_ms

    def cpu_util(self, rate: float, hosts: int | None = None) -> float:
        arrivals = rate * self.arrivals_per_request
        return queueing.utilization(self.servers(hosts), self.capacity_ms / 1e3, arrivals)

    def nic_util(self, rate: float, hosts: int | None = None) -> float:
        hosts = self.hosts if hosts is None else hosts
        return rate / hosts * self.bytes_per_request / self.kind.nic_bytes_per_s

    def memory_ok(self, hosts: int) -> bool:
        per_host = self.memory_bytes / hosts + (2 * SHARD_MARGIN_BYTES if self.memory_bytes else 0)
        per_host += self.memory_per_host
        return per_host <= self.kind.memory_gib * GIB * MEMORY_SHARE

    def cost(self) -> float:
        return self.hosts * self.kind.price_per_hour

    def describe(self, rate: float) -> dict:
        return {
            "pool": self.name,
            "kind": self.kind.kind,
            "hosts": self.hosts,
            "servers_per_host": self.servers_per_host,
            "service_ms": round(self.service_ms, 4),
            "saturated_service_ms": round(self.capacity_ms, 4),
            "cpu_utilization": round(self.cpu_util(rate), 3),
            "nic_utilization": round(self.nic_util(rate), 3),
            "p99_ms": round(self.p99_ms(rate), 3),
            "binding": self.binding,
            "cost_per_hour": round(self.cost(), 4),
            **self.extra,
        }


@dataclass
class Mix:
    pools: list[Pool]
    fixed_ms: float  # serialization and round trips, independent of load
    problem: str = ""  # why this mix cannot meet the target ("" when it does)

    def cost(self) -> float:
        return sum(p.cost() for p in self.pools)

    def p99_ms(self, rate: float) -> float:
        """Summing the stages' p99s: an upper bound of the request's p99."""
        return self.fixed_ms + sum(p.p99_ms(rate) for p in self.pools)

    def max_rate(self, target: Target) -> float:
        """The highest rate at which the predicted p99 stays within the target (bisection)."""
        lo, hi = 0.0, target.rate
        while self.p99_ms(hi) <= target.p99_ms and hi < 1e9:
            lo, hi = hi, hi * 2
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.p99_ms(mid) <= target.p99_ms else (lo, mid)
        return lo

    def describe(self, target: Target) -> dict:
        return {
            "cost_per_hour": round(self.cost(), 4),
            "p99_ms": round(self.p99_ms(target.rate), 3),
            "max_rate": round(self.max_rate(target), 1),
            "fixed_ms": round(self.fixed_ms, 3),
            "pools": [p.describe(target.rate) for p in self.pools],
        }


def dense_ms(profile: dict, dtype: str, threads: int | str, rows: int) -> float:
    """The profiled ms of a batch of `rows` on `threads` CPU threads or the GPU, linear
    between the measured batch sizes and beyond the largest (time grows with rows once the
    batch fills the cores)."""
    timed = profile["cuda"]["dense"] if threads == GPU else profile["dense"]
    per_batch = timed[dtype] if threads == GPU else timed[dtype][str(threads)]
    points = sorted((int(r), ms) for r, ms in per_batch.items())
    if not points:
        raise UsageError(f"profile: no dense timings for {dtype} on {threads} threads")
    if len(points) == 1 or rows <= points[0][0]:
        return points[0][1] * (rows / points[0][0] if len(points) == 1 else 1.0)
    for (r0, m0), (r1, m1) in itertools.pairwise(points):
        if rows <= r1:
            return m0 + (m1 - m0) * (rows - r0) / (r1 - r0)
    (r0, m0), (r1, m1) = points[-2], points[-1]
    return max(m1, m1 + (m1 - m0) * (rows - r1) / (r1 - r0))


def router_us(profile: dict, candidates: int) -> tuple[float, str]:
    """The router's CPU per request: measured in the profile, else the model above."""
    measured = profile.get("router", {}).get("cpu_us_per_request")
    if measured:
        return float(measured), "measured"
    b = profile["bytes_per_candidate"]
    through = candidates * (
        b["request"] + b["lookup_request"] + b["lookup_reply"] + b["rank"] + 2 * b["reply"]
    )
    return ROUTER_FIXED_US + ROUTER_NS_PER_BYTE * through / 1e3, "estimated"


def ranker_overhead_ms(profile: dict, candidates: int) -> float:
    """A CPU ranker's time per request beyond its dense program (decoding the request,
    encoding the scores, the serving loop): the ranker's CPU per request in the profile's
    served run (one thread, the bundle's default dtype) less the dense program's profiled
    time for the same rows, both CPU time. Validation on the testbed found it 1x-2x the dense
    time for dlrm at 32 candidates; left out, the rankers' capacity was overstated about 3x
    (docs/sizing.md, "Validation"). 0 when the profile did not serve the bundle."""
    measured = profile.get("router", {}).get("ranker_cpu_us_per_request")
    dense = profile.get("dense", {})
    if not measured or not dense:
        return 0.0
    dtype = default_dtype(profile)
    if "1" not in dense[dtype]:
        return 0.0
    return max(measured / 1e3 - dense_ms(profile, dtype, 1, candidates), 0.0)


class Sizer:
    def __init__(
        self,
        manifest: dict,
        profile: dict,
        kinds: list[MachineKind],
        target: Target,
        cap_room: float | None = None,
    ):
        """`cap_room`: for a testbed catalog, the most cores a plan's hosts' caps may add up
        to (catalog.testbed_room): a plan over it could not be served here."""
        if not target.rate > 0 or not target.p99_ms > 0:
            raise UsageError(
                f"--rate and --p99-ms must be positive, got {target.rate}, {target.p99_ms}"
            )
        if not 0 < target.headroom <= 1:
            raise UsageError(f"--headroom: expected a share in (0, 1], got {target.headroom}")
        self.profile, self.kinds, self.target = profile, kinds, target
        self.cap_room = cap_room
        self.candidates = int(profile["traffic"]["candidates"])
        self.table_bytes = float(sum(t["rows"] * t["row_bytes"] for t in manifest["tables"]))
        self.bytes = profile["bytes_per_candidate"]
        self.router_us, self.router_source = router_us(profile, self.candidates)
        self.ranker_overhead_ms = ranker_overhead_ms(profile, self.candidates)
        self.capped = profile.get("capped") or {}
        self._scales: dict[str, float] = {}  # kind -> its pools' wait scale at this target
        shard = profile["shard"]
        self.shard_call_us, self.shard_ns_per_id = shard["call_us"], shard["ns_per_id"]
        self.ids = shard["ids_per_request"]
        self._check_memory()

    def _check_memory(self) -> None:
        """Every table must fit the catalog: cut over as many shard hosts as may be bought."""
        best = max(self.kinds, key=lambda k: k.memory_gib * min(k.max_count, MAX_HOSTS))
        hosts = min(best.max_count, MAX_HOSTS)
        room = hosts * (best.memory_gib * GIB * MEMORY_SHARE - 2 * SHARD_MARGIN_BYTES)
        if 2 * self.table_bytes > room:
            raise UsageError(
                f"no machine in the catalog can hold the tables: {self.table_bytes / GIB:.1f} "
                f"GiB, twice (two replicas of every row), need {2 * self.table_bytes / GIB:.1f} "
                f"GiB; the most the catalog offers is {hosts} x {best.kind} = "
                f"{max(room, 0) / GIB:.1f} GiB for rows"
            )

    # -- pools ---------------------------------------------------------------------------

    def measured(self, kind: MachineKind) -> dict | None:
        """What `cleave profile --capped` measured on hosts of this kind (the same cap)."""
        measured = self.capped.get(kind.kind)
        if not measured or abs(measured["cores"] - testbed_cores(kind)) > 1e-9:
            return None
        return measured

    def speeds(self, kind: MachineKind, pool: str) -> tuple[float, float, float]:
        """(low-load speed, saturated speed, wait scale) of one of the kind's cores for the
        pool's role, speeds relative to the profiled machine's core: the catalog's
        `cpu_speed` and the plain queueing wait, or where the profile measured hosts of this
        kind, that speed over the CPU per request the role really spent there (as a factor
        of the profile's) and the wait's factor fitted to this target (wait_scale)."""
        measured = self.measured(kind)
        if measured is None:
            return kind.cpu_speed, kind.cpu_speed, 1.0
        low, saturated = measured["low"]["factor"][pool], self._saturated(measured, pool)
        return kind.cpu_speed / low, kind.cpu_speed / saturated, self.wait_scale(kind)

    def _saturated(self, measured: dict, pool: str) -> float:
        """The role's CPU factor when its pool is the bottleneck at this target: a ranker
        joins what queued into one batch, so what a request costs depends on how long
        requests may queue. The factor at the measured step that met the target at the
        highest rate, towards the next step's as the target nears that step's p99
        (capped.crossing); without steps the most loaded figure, with none that met the
        target the low-load one."""
        steps = sorted(measured.get("steps", []), key=lambda st: st["rate"])
        if not steps:
            return measured["saturated"]["factor"][pool]
        found = crossing(steps, self.target.p99_ms)
        if found is None:
            return measured["low"]["factor"][pool]
        i, share, crossed = found
        here = steps[i]["factor"][pool]
        return here + (steps[i + 1]["factor"][pool] - here) * share if crossed else here

    def wait_scale(self, kind: MachineKind) -> float:
        """The factor on the queueing wait of the kind's pools, for this target: the one at
        which the model's pools of the measured deployment (capped.calibration_pools) reach
        the target at the rate where the measured steps' p99 crossed it (capped.crossing),
        so the model reproduces what the measured deployment did and scales it by host
        counts. Where they did not cross it, the profile's least-squares fit over all steps."""
        measured = self.measured(kind)
        if measured is None:
            return 1.0
        if kind.kind not in self._scales:
            self._scales[kind.kind] = measured.get("wait_scale", 1.0)  # the pools built below
            rate = crossing_rate(measured.get("steps", []), self.target.p99_ms)
            if rate is not None:
                hosts = measured.get("hosts", ONE_PATH)
                self._scales[kind.kind] = self._fit_scale(kind, hosts, rate)
        return self._scales[kind.kind]

    def _fit_scale(self, kind: MachineKind, hosts: dict[str, int], rate: float) -> float:
        pools = calibration_pools(self, kind, hosts)
        mix = Mix(pools, self.fixed_ms(pools))
        goal = Target(1.0, self.target.p99_ms)

        def reached(scale: float) -> float:  # falls as the scale grows
            for p in pools:
                p.wait_scale = scale
            return mix.max_rate(goal)

        lo, hi = MIN_WAIT_SCALE, MAX_WAIT_SCALE
        if reached(lo) <= rate:
            return lo
        if reached(hi) >= rate:
            return hi
        for _ in range(30):  # bisection on the log of the scale
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if reached(mid) >= rate else (lo, mid)
        return round(math.sqrt(lo * hi), 4)

    def calibrated(self) -> list[str]:
        """The catalog's kinds whose CPU per request was measured on capped hosts."""
        return [k.kind for k in self.kinds if self.measured(k) is not None]

    def rankers(self, kind: MachineKind, dtype: str, threads: int | str) -> Pool:
        """A ranker process per `threads` cores, as many as the host's memory holds, each
        running one request per batch; on GPUs one per GPU (its speed the GPU profile's, not
        cpu_speed), joining the requests that wait into batches of up to RANKER_MAX_BATCH
        rows: a GPU's batch takes little longer for more rows, so under load a request
        costs its share of the batch and waits for the whole batch."""
        if threads == GPU:
            joined = max(1, RANKER_MAX_BATCH // self.candidates)
            batch = dense_ms(self.profile, dtype, GPU, joined * self.candidates)
            per_host, service, extra = kind.gpus, batch / joined, batch - batch / joined
            saturated, scale = 0.0, 1.0
        else:
            memory = int(kind.memory_gib * MEMORY_SHARE / RANKER_MEMORY_GIB)
            per_host = max(1, min(kind.cpus // threads, memory))
            dense = dense_ms(self.profile, dtype, threads, self.candidates)
            low, saturated, scale = self.speeds(kind, "rankers")
            service = (dense + self.ranker_overhead_ms) / low
            saturated = (dense + self.ranker_overhead_ms) / saturated
            joined, extra = 1, 0.0
        return Pool(
            "rankers",
            kind,
            1,
            per_host,
            service,
            saturated_ms=saturated,
            wait_scale=scale,
            bytes_per_request=self.candidates * (self.bytes["rank"] + self.bytes["reply"]),
            batch_ms=extra,
            extra={"dtype": dtype, "threads": threads, "requests_per_batch": joined},
        )

    def shards(self, kind: MachineKind, hosts: int, hit_rate: float = 0.0) -> Pool:
        """`hosts` range groups of two replicas: a request makes one lookup per group, for
        the ids the routers' caches do not answer."""
        missed = 1.0 - hit_rate
        per_group_us = self.shard_call_us + missed * self.ids * self.shard_ns_per_id / 1e3 / hosts
        reply = (
            self.candidates * missed * (self.bytes["lookup_reply"] + self.bytes["lookup_request"])
        )
        low, saturated, scale = self.speeds(kind, "shards")
        return Pool(
            "shards",
            kind,
            hosts,
            kind.cpus,
            per_group_us / 1e3 / low,
            saturated_ms=per_group_us / 1e3 / saturated,
            wait_scale=scale,
            arrivals_per_request=hosts,
            # The slowest of `hosts` lookups decides: each must be within 1 - 0.01/hosts.
            quantile=queueing.QUANTILE ** (1.0 / hosts),
            bytes_per_request=reply,
            memory_bytes=2 * self.table_bytes,
            hit_rate=hit_rate,
        )

    def regrown(self, pool: Pool, hosts: int) -> Pool:
        """A copy of the pool with `hosts` hosts: shards are rebuilt (their range groups, so
        their service times, follow the hosts)."""
        if pool.name != "shards":
            return dataclasses.replace(pool, hosts=hosts, extra=dict(pool.extra))
        grown = self.shards(pool.kind, hosts, pool.hit_rate)
        grown.binding = pool.binding
        return grown

    def routers(self, kind: MachineKind, cache: dict | None = None) -> Pool:
        """`cache`: the hottest rows each router keeps (a point of the profile's hit curve);
        what it answers crosses no NIC."""
        b = self.bytes
        missed = 1.0 - (cache["hit_rate"] if cache else 0.0)
        inward = b["request"] + missed * b["lookup_reply"] + b["reply"]
        outward = missed * b["lookup_request"] + b["rank"] + b["reply"]
        low, saturated, scale = self.speeds(kind, "routers")
        return Pool(
            "routers",
            kind,
            1,
            kind.cpus,
            self.router_us / 1e3 / low,
            saturated_ms=self.router_us / 1e3 / saturated,
            wait_scale=scale,
            bytes_per_request=self.candidates * max(inward, outward),
            memory_per_host=ROUTER_MEMORY_BYTES + (cache["bytes"] if cache else 0),
            extra={
                "cpu_us_per_request": round(self.router_us, 1),
                "source": self.router_source,
                "cache_bytes": cache["bytes"] if cache else 0,
                "cache_hit_rate": cache["hit_rate"] if cache else 0.0,
            },
        )

    def monolithic(self, kind: MachineKind, dtype: str, threads: int) -> Pool:
        lookups_ms = self.ids * self.shard_ns_per_id / 1e6
        dense = dense_ms(self.profile, dtype, threads, self.candidates)
        dense += self.ranker_overhead_ms
        # The router's and the lookups' CPU run on the request's own threads here.
        service = (dense + (self.router_us / 1e3 + lookups_ms) / threads) / kind.cpu_speed
        b = self.bytes
        return Pool(
            "monolithic",
            kind,
            1,
            max(1, kind.cpus // threads),
            service,
            bytes_per_request=self.candidates * max(b["request"], b["reply"]),
            memory_bytes=self.table_bytes,  # every host holds every table: per host, below
            extra={"dtype": dtype, "threads": threads},
        )

    # -- the search ----------------------------------------------------------------------

    def fixed_ms(self, pools: list[Pool]) -> float:
        by = {p.name: p for p in pools}
        ms = 0.0
        if "rankers" in by:
            ms += self.candidates * self.bytes["rank"] / by["rankers"].kind.nic_bytes_per_s * 1e3
            s = by["shards"]
            reply = self.candidates * (1 - s.hit_rate) * self.bytes["lookup_reply"] / s.hosts
            ms += reply / s.kind.nic_bytes_per_s * 1e3 + 3 * RTT_MS  # client, shards, ranker
        else:
            ms += RTT_MS
        return ms

    def fewest(self, pool: Pool, least: int) -> Pool | None:
        """A copy of the pool with the fewest hosts (at least `least`) within the headroom and
        the memory; None when the kind's count cannot."""
        rate, headroom = self.target.rate, self.target.headroom
        for hosts in range(least, _most(pool) + 1):
            pool = self.regrown(pool, hosts)
            checks = {
                "cpu": pool.cpu_util(rate, hosts) <= headroom,
                "nic": pool.nic_util(rate, hosts) <= headroom,
                "memory": pool.name == "monolithic" or pool.memory_ok(hosts),
            }
            if all(checks.values()):
                pool.binding = _binding(pool, rate, hosts, least)
                return pool
        return None

    def fewest_pools(
        self, router_kind, shard_kind, ranker_kind, dtype, threads, cache=None
    ) -> list[Pool | None]:
        """Each pool with its fewest hosts for the rate (shards at least two groups), before
        the latency and the spare: None for a pool the kind's count cannot carry."""
        hit = cache["hit_rate"] if cache else 0.0
        return [
            self.fewest(self.routers(router_kind, cache), 1),
            self.fewest(self.shards(shard_kind, 1, hit), 2),
            self.fewest(self.rankers(ranker_kind, dtype, threads), 1),
        ]

    def mix(self, router_kind, shard_kind, ranker_kind, dtype, threads, cache) -> Mix:
        pools = self.fewest_pools(router_kind, shard_kind, ranker_kind, dtype, threads, cache)
        if any(p is None for p in pools):
            pool_names = ("routers", "shards", "rankers")
            names = [n for n, p in zip(pool_names, pools, strict=True) if p is None]
            return Mix([], 0.0, f"{', '.join(names)}: more hosts than the catalog offers")
        mix = self._meet_latency(Mix(pools, self.fixed_ms(pools)))
        caps = sum(p.hosts * testbed_cores(p.kind) for p in mix.pools)
        if not mix.problem and self.cap_room is not None and caps > self.cap_room + 1e-9:
            mix.problem = (
                f"testbed: the hosts' CPU caps add up to {caps:g} cores; this machine leaves "
                f"{self.cap_room:g} to them"
            )
        return mix

    def monolithic_mix(self, kind, dtype, threads) -> Mix:
        if self.table_bytes + 2 * SHARD_MARGIN_BYTES > kind.memory_gib * GIB * MEMORY_SHARE:
            return Mix([], 0.0, f"{kind.kind} cannot hold every table")
        pool = self.fewest(self.monolithic(kind, dtype, threads), 1)
        if pool is None:
            return Mix([], 0.0, f"monolithic on {kind.kind}: more hosts than the catalog offers")
        return self._meet_latency(Mix([pool], self.fixed_ms([pool])))

    def _meet_latency(self, mix: Mix) -> Mix:
        """Adds hosts where they buy the most p99 per dollar until the target is met, then
        one spare host per pool."""
        rate, goal = self.target.rate, self.target.p99_ms
        for _ in range(4 * MAX_HOSTS):
            now = mix.p99_ms(rate)
            if now <= goal:
                break
            best, gain = None, 0.0
            for i, p in enumerate(mix.pools):
                if p.hosts >= _most(p):
                    continue
                trial = list(mix.pools)
                trial[i] = self.regrown(p, p.hosts + 1)
                per_dollar = (now - Mix(trial, self.fixed_ms(trial)).p99_ms(rate)) / (
                    p.kind.price_per_hour
                )
                if per_dollar > gain:
                    best, gain = (i, trial[i]), per_dollar
            if best is None:
                return Mix(mix.pools, mix.fixed_ms, _latency_problem(mix, rate, goal, now))
            i, grown = best
            grown.binding = "latency"
            mix.pools[i] = grown
            mix.fixed_ms = self.fixed_ms(mix.pools)
        else:
            return Mix(mix.pools, mix.fixed_ms, "latency: no host count meets the p99")
        for i, p in enumerate(mix.pools):  # N+1
            if p.hosts < _most(p):
                mix.pools[i] = self.regrown(p, p.hosts + 1)
            else:
                mix.problem = f"{p.name}: no spare {p.kind.kind} left for N+1"
        mix.fixed_ms = self.fixed_ms(mix.pools)
        return mix

    def options(self) -> tuple[list[tuple], list[tuple]]:
        """(disaggregated mixes, monolithic mixes) to try: every kind, dtype and thread count
        the profile measured, and GPU rankers on kinds with GPUs when the profile timed the
        dense program on one (the monolith runs on CPUs)."""
        dense = self.profile["dense"]
        ranker_options = [
            (k, d, int(t)) for k in self.kinds for d in dense for t in dense[d] if int(t) <= k.cpus
        ]
        gpu_dense = self.profile.get("cuda", {}).get("dense", {})
        gpu_options = [(k, d, GPU) for k in self.kinds if k.gpus for d in gpu_dense]
        if not ranker_options:
            raise UsageError(
                "no machine kind has as many cores as the profile's thread counts "
                f"({sorted({int(t) for d in dense for t in dense[d]})})"
            )
        disaggregated = [
            (r, s, k, d, t, c)
            for r in self.kinds
            for s in self.kinds
            for k, d, t in ranker_options + gpu_options
            for c in self.caches()
        ]
        return disaggregated, ranker_options

    def caches(self) -> list[dict | None]:
        """No cache, and each point of the profile's hit curve: the hottest rows a router
        keeps (a fixed cache, in every router), the share of lookups it answers. The router
        keys a pooled bag by its ordered ids, so only bags of one id hit like rows; a bag of
        several ids seldom repeats exactly, and the model counts no hit for it."""
        if float(self.profile["traffic"]["ids_per_candidate"]) > 1:
            return [None]
        curve = self.profile.get("cache") or {}
        points = zip(curve.get("bytes", []), curve.get("hit_rate", []), strict=False)
        return [None, *({"bytes": b, "hit_rate": h} for b, h in points if b > 0 and h > 0)]

    def size(self) -> dict:
        disaggregated, ranker_options = self.options()
        mixes = [(self.mix(*o), o) for o in disaggregated]
        good = sorted((m for m in mixes if not m[0].problem), key=lambda m: m[0].cost())
        mono = [(self.monolithic_mix(*o), o) for o in ranker_options]
        mono_good = sorted((m for m in mono if not m[0].problem), key=lambda m: m[0].cost())
        if not good:
            raise UsageError(self._unreachable(mixes))
        chosen, option = good[0]
        result = {
            "target": {
                "rate": self.target.rate,
                "p99_ms": self.target.p99_ms,
                "headroom": self.target.headroom,
                "candidates": self.candidates,
            },
            "chosen": {**chosen.describe(self.target), **_option(option)},
            "runners_up": [
                {**m.describe(self.target), **_option(o)} for m, o in _distinct(good[1:], 3)
            ],
            "monolithic": (
                {**mono_good[0][0].describe(self.target), **_option(mono_good[0][1], True)}
                if mono_good
                else {"problem": "; ".join(sorted({m.problem for m, _ in mono}))}
            ),
            "router_cpu_us": {"value": round(self.router_us, 1), "source": self.router_source},
            "ranker_overhead_ms": round(self.ranker_overhead_ms, 4),
            "capped_kinds": self.calibrated(),
        }
        result["chosen_mix"] = chosen
        return result

    def _unreachable(self, mixes: list[tuple[Mix, tuple]]) -> str:
        """The target cannot be met: which constraint, and the best any mix can do."""
        problems = sorted({m.problem for m, _ in mixes})
        with_pools = [m for m, _ in mixes if m.pools]
        best = ""
        if with_pools:
            fastest = min(with_pools, key=lambda m: m.p99_ms(self.target.rate))
            floor = fastest.p99_ms(self.target.rate)
            most = max(m.max_rate(self.target) for m in with_pools)
            at_target = (
                f"{most:.0f}/s at a p99 of {self.target.p99_ms:g} ms"
                if most >= 1
                else f"no rate at a p99 of {self.target.p99_ms:g} ms"
            )
            rate = self.target.rate
            best = f"; the best it can do: p99 {floor:.2f} ms at {rate:g}/s, or {at_target}"
        return (
            f"cannot meet {self.target.rate:g} requests/s at a p99 of {self.target.p99_ms:g} ms "
            f"with this catalog: {problems[0]}"
            + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            + best
        )


def _most(pool: Pool) -> int:
    return min(pool.kind.max_count, MAX_HOSTS)


def _binding(pool: Pool, rate: float, hosts: int, least: int) -> str:
    if hosts == least:
        return "minimum" if pool.name != "shards" else "minimum (two replicas)"
    fewer = hosts - 1
    if pool.name != "monolithic" and not pool.memory_ok(fewer):
        return "memory"
    return "nic" if pool.nic_util(rate, fewer) > pool.cpu_util(rate, fewer) else "cpu"


def _latency_problem(mix: Mix, rate: float, goal: float, floor: float) -> str:
    service = mix.fixed_ms + sum(p.service_ms for p in mix.pools)
    return (
        f"latency: the service times alone add up to {service:.2f} ms (p99 {floor:.2f} ms at "
        f"the most hosts), above the {goal:g} ms target"
    )


def _option(option: tuple, monolithic: bool = False) -> dict:
    if monolithic:
        kind, dtype, threads = option
        return {
            "kinds": {"monolithic": kind.kind},
            "dtype": dtype,
            "threads": threads,
            "device": "cpu",
        }
    router, shard, ranker, dtype, threads, cache = option
    return {
        "kinds": {"routers": router.kind, "shards": shard.kind, "rankers": ranker.kind},
        "dtype": dtype,
        # A GPU ranker's own CPU work (decoding, copies) is one thread's.
        "threads": 1 if threads == GPU else threads,
        "device": GPU if threads == GPU else "cpu",
        "router_cache_bytes": cache["bytes"] if cache else 0,
    }


def _distinct(mixes: list, n: int) -> list:
    """The first `n` mixes that differ in their pools' kinds and counts."""
    seen, out = set(), []
    for m, o in mixes:
        key = tuple((p.kind.kind, p.hosts) for p in m.pools) + (o[3], o[4])
        key += (o[5]["bytes"] if o[5] else 0,)
        if key not in seen:
            seen.add(key)
            out.append((m, o))
        if len(out) == n:
            break
    return out
