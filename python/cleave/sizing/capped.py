"""What each role spends per request on a capped testbed host, and how the p99 of a deployment
of such hosts grows with the rate (docs/sizing.md, "Capped hosts").

A share of a core is not that share of a core's speed: on a tenth of a core the routers of
the validation runs spent 2.4-2.9x and the rankers 1.2-2.8x the CPU per request the profile
measured on a whole core (a request that finds its group's quota spent waits for the next
period and runs cold; TCP over a veth pays the receiver's softirq in the sender's context),
while a ranker that is the bottleneck joins queued requests into one batch and spends less.
And the wait is not M/M/c's. So for each kind of a testbed catalog, `cleave profile --capped
CATALOG` serves the bundle on the testbed as the smallest plan `cleave size` writes on that
kind (each pool's fewest hosts and one spare: two routers, three shard hosts, two rankers),
and measures every role's CPU per request one request at a time (what a request sees: its
own time) and at open-loop steps up past what the deployment answers, bisected where their
p99 crosses the target the plans will be sized for (what a pool costs when it is the
bottleneck, and the rate at which the deployment meets the target). Each CPU figure is kept
as a factor over what the whole-core profile says that role costs, so `cleave size` applies
it to any dtype, batch size and host count of that kind, and fits its wait to the crossing
(search.Sizer.wait_scale). One path of hosts (one router, two shard hosts, one ranker) was
measured before: it answered 1.2-1.8x what each path of a two-router, two-ranker plan did
(docs/sizing.md, "Capped hosts"), so predictions from it missed by as much."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np

from cleave.errors import UsageError
from cleave.sizing.catalog import is_testbed, load_catalog, testbed_cores, testbed_room

ROLES = ("routers", "shards", "rankers")
SEQUENTIAL, QUICK_SEQUENTIAL = 40, 8  # requests one at a time (low load)
CLOSED_S, QUICK_CLOSED_S = 4.0, 1.0  # seconds of closed-loop load: the steps' scale
CLIENTS_PER_ROUTER = 8  # closed-loop clients: enough to keep every role of a path busy
# Open-loop steps: from FIRST_STEP of the closed-loop rate up by STEP_GROWTH until one is
# past what the deployment answers (OVERLOAD), at most MAX_STEPS, then BISECTIONS between
# the steps where the p99 crosses the target; each for seconds enough for STEP_SAMPLES
# requests within these bounds (a p99 of 40 requests is their maximum: the crossing of a
# target moved by a third between runs).
FIRST_STEP, STEP_GROWTH, MAX_STEPS, BISECTIONS = 0.5, 1.2, 10, 2
QUICK_STEPS = (0.5, 1.6)
STEP_S, MAX_STEP_S, STEP_SAMPLES = 4.0, 12.0, 100
OVERLOAD_ANSWERED, OVERLOAD_ERRORS = 0.8, 0.1  # answered under this share, or refused over
MAX_ERROR_SHARE = 0.01  # a step (here and in validate.py) with more refused misses its target
BODIES = 16
MIN_WAIT_SCALE, MAX_WAIT_SCALE = 0.05, 20.0  # a fit outside says the model is broken, not slow
# The measured deployment where the smallest plan's caps do not fit this machine.
ONE_PATH = {"routers": 1, "shards": 2, "rankers": 1}
# The calibration plan's p99 target when none is given: it sets the routers' budget as in a
# plan sized for it (plan.write_plan: the default 1 s, or twice the target when that is more),
# so the steps queue and refuse as the plans will, and the steps are bisected at it.
CALIBRATION_P99_MS = 500.0


def measure_capped(
    bundle_dir: Path,
    profile: dict,
    catalog: str,
    quick: bool,
    log,
    p99_ms: float | None = None,
) -> dict:
    """{kind: {cores, hosts, low, saturated, steps, ...}} for every kind of the testbed
    catalog: each role's CPU ms per request and its factor over the profile's, and each
    step's p99 (cleave size fits its wait to where they cross a plan's target)."""
    from cleave.bundle import manifest as manifest_io
    from cleave.sizing.search import Sizer, Target

    kinds = testbed_kinds(catalog)
    manifest = manifest_io.read(bundle_dir, whole=False)
    p99_ms = p99_ms or CALIBRATION_P99_MS
    base = {k: v for k, v in profile.items() if k != "capped"}  # whole-core figures only
    out = {}
    with tempfile.TemporaryDirectory(prefix="cleave-capped-") as tmp:
        for kind in kinds:
            sizer = Sizer(manifest, base, [kind], Target(1.0, p99_ms))
            hosts = calibration_hosts(sizer, kind)
            log(
                f"profile: capped hosts of kind {kind.kind} ({testbed_cores(kind):g} "
                f"core): {hosts['routers']} routers, {hosts['shards']} shard hosts, "
                f"{hosts['rankers']} rankers"
            )
            plan = Path(tmp) / f"{kind.kind}.yaml"
            _write_plan(sizer, bundle_dir, kind, hosts, catalog, plan)
            model = model_cpu_ms(sizer, hosts["shards"])
            measured = _serve_and_measure(
                plan, manifest, base, kind, hosts, model, p99_ms, quick, log
            )
            measured["wait_scale"] = wait_scale(manifest, base, kind, measured)
            out[kind.kind] = measured
    return out


def wait_scale(manifest: dict, profile: dict, kind, measured: dict) -> float:
    """How much longer than the queueing model's the measured wait was: the least-squares
    factor on the model's p99 wait (the model's own pools for the measured deployment, with
    these hosts' CPU figures) that best fits each step's p99 beyond its service times. What
    cleave size uses for a target the steps did not cross (it fits the crossing otherwise).
    1 when no step was below the model's capacity."""
    from cleave.sizing.search import Sizer, Target

    trial = {**profile, "capped": {kind.kind: {**measured, "wait_scale": 1.0}}}
    sizer = Sizer(manifest, trial, [kind], Target(1.0, 1e9))
    pools = calibration_pools(sizer, kind, measured["hosts"])
    own = sizer.fixed_ms(pools) + sum(p.service_ms + p.batch_ms for p in pools)
    num = den = 0.0
    for step in measured["steps"]:
        wait = sum(p.p99_ms(step["rate"]) for p in pools) + sizer.fixed_ms(pools) - own
        if math.isfinite(wait) and wait > 0:
            num += wait * (step["p99_ms"] - own)
            den += wait * wait
    return round(min(max(num / den, MIN_WAIT_SCALE), MAX_WAIT_SCALE), 3) if den else 1.0


def testbed_kinds(catalog: str) -> list:
    """The catalog's kinds, refused unless it describes the testbed's hosts."""
    from cleave.plan.files import read_yaml

    kinds = load_catalog(catalog)
    if not is_testbed(read_yaml(catalog, "catalog"), str(catalog)):
        raise UsageError(
            f"--capped {catalog}: not a testbed catalog (no `testbed: true` at its top): only "
            f"the testbed's own hosts can be measured here"
        )
    return kinds


def calibration_hosts(sizer, kind) -> dict[str, int]:
    """The measured deployment's host counts: the smallest plan cleave size writes on this
    kind (each pool's fewest hosts at the sizer's rate, one spare; most plans for the testbed
    are it), or one path where its caps do not fit here."""
    fewest = sizer.fewest_pools(kind, kind, kind, default_dtype(sizer.profile), 1)
    room = testbed_room()
    smallest = {p.name: p.hosts + 1 for p in fewest if p is not None}
    for hosts in (smallest, ONE_PATH):
        if set(hosts) == set(ROLES) and sum(hosts.values()) * testbed_cores(kind) <= room + 1e-9:
            return hosts
    raise UsageError(
        f"--capped: kind {kind.kind!r}: even one path of its hosts (1 router, 2 shard hosts, "
        f"1 ranker) caps {4 * testbed_cores(kind):g} cores; this machine leaves {room:g} to them"
    )


def model_cpu_ms(sizer, shard_hosts: int) -> dict[str, float]:
    """What the whole-core profile says each role spends on one request of the calibration
    deployment (a router, `shard_hosts` range groups, a float32 ranker of one thread)."""
    from cleave.sizing.search import dense_ms

    profile = sizer.profile
    ids_us = sizer.ids * sizer.shard_ns_per_id / 1e3
    return {
        "routers": sizer.router_us / 1e3,
        "shards": (shard_hosts * sizer.shard_call_us + ids_us) / 1e3,
        "rankers": dense_ms(profile, default_dtype(profile), 1, sizer.candidates)
        + sizer.ranker_overhead_ms,
    }


def default_dtype(profile: dict) -> str:
    dense = profile["dense"]
    return "float32" if "float32" in dense else next(iter(dense))


def calibration_pools(sizer, kind, hosts: dict[str, int]) -> list:
    """The model's pools of the measured deployment on hosts of `kind`, its rankers of one
    thread in the profile's default dtype."""
    dtype = default_dtype(sizer.profile)
    return [
        sizer.regrown(sizer.routers(kind), hosts["routers"]),
        sizer.shards(kind, hosts["shards"]),
        sizer.regrown(sizer.rankers(kind, dtype, 1), hosts["rankers"]),
    ]


def summary(samples, rate: float) -> dict:
    """A load step's rate, requests sent and refused, and p50 and p99 of those answered
    (None when none was), as calibration and validation steps record them."""
    ok = [s.latency_s * 1e3 for s in samples if not s.error]
    return {
        "rate": round(rate, 2),
        "sent": len(samples),
        "errors": len(samples) - len(ok),
        "p50_ms": round(float(np.percentile(ok, 50)), 3) if ok else None,
        "p99_ms": round(float(np.percentile(ok, 99)), 3) if ok else None,
    }


def meets(step: dict, goal_ms: float) -> bool:
    """A step met a p99 target: its p99 within, at most MAX_ERROR_SHARE of it refused."""
    p99 = step["p99_ms"]
    return p99 is not None and p99 <= goal_ms and step["errors"] <= MAX_ERROR_SHARE * step["sent"]


def crossing(steps: list[dict], goal_ms: float) -> tuple[int, float, bool] | None:
    """Where steps (sorted by offered rate) cross a p99 target, as validate.py's search
    finds it: (i, share, crossed), step i the last that met the target (p99 within, at most
    MAX_ERROR_SHARE refused) before the first that missed it, `share` how far towards that
    one's rate the target lies by their p99s (0 when it missed by its refusals alone);
    `crossed` False when none missed. None when no step met it."""
    met = [meets({"errors": 0, "sent": 1, **st}, goal_ms) for st in steps]
    if not any(met):
        return None
    first = met.index(True)
    missed = next((j for j in range(first + 1, len(steps)) if not met[j]), None)
    if missed is None:
        return len(steps) - 1, 0.0, False
    here, above = steps[missed - 1]["p99_ms"], steps[missed]["p99_ms"]
    share = (goal_ms - here) / (above - here) if above > goal_ms else 0.0
    return missed - 1, min(max(share, 0.0), 1.0), True


def crossing_rate(steps: list[dict], goal_ms: float) -> float | None:
    """The rate at which the steps' p99 crosses the target (crossing), None where they did
    not cross it."""
    steps = sorted(steps, key=lambda st: st["rate"])
    found = crossing(steps, goal_ms)
    if found is None or not found[2]:
        return None
    i, share, _ = found
    return steps[i]["rate"] + share * (steps[i + 1]["rate"] - steps[i]["rate"])


def _write_plan(sizer, bundle_dir, kind, hosts: dict, catalog, path: Path) -> None:
    from cleave.sizing.plan import write_plan
    from cleave.sizing.search import Mix, _option

    pools = calibration_pools(sizer, kind, hosts)
    mix = Mix(pools, sizer.fixed_ms(pools))
    target = sizer.target
    result = {
        "target": {"rate": target.rate, "p99_ms": target.p99_ms, "candidates": sizer.candidates},
        "chosen": {
            **mix.describe(target),
            **_option((kind, kind, kind, default_dtype(sizer.profile), 1, None)),
        },
        "catalog": {"path": str(catalog), "testbed": True},
        "traffic": dict(sizer.profile["traffic"]),
    }
    write_plan(bundle_dir, mix, result, path)


def _bodies(manifest: dict, profile: dict) -> list:
    from cleave.bench.loadgen import binary_infer_body
    from cleave.sizing.router import synthetic_inputs

    traffic = profile["traffic"]
    rng = np.random.default_rng(1)
    return [
        binary_infer_body(
            synthetic_inputs(manifest, traffic["candidates"], traffic["ids_per_candidate"], rng)
        )
        for _ in range(BODIES)
    ]


def _serve_and_measure(
    plan, manifest, profile, kind, hosts: dict, model: dict, p99_ms: float, quick: bool, log
) -> dict:
    from cleave.bench.harness.target import Target
    from cleave.bench.loadgen import closed_loop_spread, sequential
    from cleave.plan.files import load_plan

    bodies = _bodies(manifest, profile)
    count = QUICK_SEQUENTIAL if quick else SEQUENTIAL
    name = load_plan(plan).name
    with Target(plan=plan, flags=["--runner", "testbed"]) as target:
        urls = [f"{u}/v2/models/{name}/infer" for u in target.urls]
        warm = sequential(urls[0], bodies, BODIES, timeout_s=30.0)
        ok = [s.latency_s * 1e3 for s in warm if not s.error]
        if not ok:
            raise UsageError(f"capped {kind.kind}: the deployment answered no request: {warm[0]}")
        before = _by_role(target)
        low = sequential(urls[0], bodies, count, timeout_s=30.0)
        low_cpu = _per_request(before, _by_role(target), low)
        closed_s = QUICK_CLOSED_S if quick else CLOSED_S
        clients = CLIENTS_PER_ROUTER * len(urls)
        closed = closed_loop_spread(urls, bodies, clients, closed_s, timeout_s=30.0)
        closed_rate = sum(1 for s in closed if not s.error) / closed_s
        load = _Load(target, urls, bodies, quick, log, float(np.median(ok)))
        steps = load.rising(closed_rate)
        load.bisect(steps, p99_ms)
    if not steps:
        raise UsageError(f"capped {kind.kind}: every request of the first step was refused")
    steps.sort(key=lambda st: st["rate"])
    cores = testbed_cores(kind)
    # The most a deployment of these hosts answered: its bottleneck's capacity, batches as
    # large as a queue under overload makes them.
    top = max(steps, key=lambda st: st["answered_rate"])
    busy_cpu = top["cpu_ms"]
    for st in steps:  # each step's CPU as factors too: cleave size picks one by its target
        st.update(_factors(st["cpu_ms"], model))
    result = {
        "cores": cores,
        "link_gbit": kind.nic_gbit,
        "hosts": hosts,
        "p99_target_ms": p99_ms,
        "model_cpu_ms": {r: round(v, 4) for r, v in model.items()},
        "low": _factors(low_cpu, model),
        "saturated": _factors(busy_cpu, model),
        # How busy each role was there (CPU seconds over wall over its caps): the pool near
        # 1 is the bottleneck, whose saturated figure is a capacity.
        "saturated_utilization": {
            r: round(busy_cpu[r] * top["answered_rate"] / 1e3 / (cores * hosts[r]), 3)
            for r in busy_cpu
        },
        "saturated_rate": top["answered_rate"],
        "closed_loop_rate": round(closed_rate, 2),
        "crossing_rate": _round(crossing_rate(steps, p99_ms)),
        "low_p50_ms": _p50(low),
        "steps": steps,
    }
    log(
        f"  {kind.kind}: low load {result['low']['cpu_ms']} ms CPU per request, saturated "
        f"{result['saturated']['cpu_ms']} at {result['saturated_rate']}/s; p99 "
        f"{p99_ms:g} ms crossed at {result['crossing_rate']}/s"
    )
    return result


class _Load:
    """Open-loop steps on the deployment, spread over its routers as validate.py's are."""

    def __init__(self, target, urls, bodies, quick: bool, log, base_ms: float):
        self.target, self.urls, self.bodies = target, urls, bodies
        self.quick, self.log, self.base_ms = quick, log, base_ms

    def rising(self, closed_rate: float) -> list[dict]:
        """Steps rising from a share of the closed-loop rate until one is past what the
        deployment answers (a queue that grows makes a ranker's batches larger, so it
        answers more than the closed loop's clients let it)."""
        shares = (
            QUICK_STEPS if self.quick else [FIRST_STEP * STEP_GROWTH**i for i in range(MAX_STEPS)]
        )
        steps = []
        for share in shares:
            step = self.step(max(0.5, share * closed_rate), len(steps))
            if step is None:  # all refused: past what it answers, nothing to measure
                break
            steps.append(step)
            refused = step["errors"] / step["sent"]
            if (
                step["answered_rate"] < OVERLOAD_ANSWERED * step["rate"]
                or refused > OVERLOAD_ERRORS
            ):
                break
        return steps

    def bisect(self, steps: list[dict], goal_ms: float) -> None:
        """Steps halfway between the two where the p99 crosses the target, as validate.py
        bisects: the crossing to within a few percent of the rate."""
        for _ in range(0 if self.quick else BISECTIONS):
            steps.sort(key=lambda st: st["rate"])
            found = crossing(steps, goal_ms)
            if found is None or not found[2]:
                return
            lo, hi = steps[found[0]]["rate"], steps[found[0] + 1]["rate"]
            self.settle()
            step = self.step((lo + hi) / 2, len(steps))
            if step is None:
                return
            steps.append(step)

    def step(self, rate: float, seed: int) -> dict | None:
        """One step: its p99, the rate answered and every role's CPU per answered request."""
        from cleave.bench.loadgen import open_loop_spread

        seconds = 1.0 if self.quick else min(MAX_STEP_S, max(STEP_S, STEP_SAMPLES / rate))
        before = _by_role(self.target)
        samples = open_loop_spread(self.urls, self.bodies, rate, seconds, timeout_s=30.0, seed=seed)
        step = summary(samples, rate)
        if step["p99_ms"] is None:
            return None
        step["cpu_ms"] = _per_request(before, _by_role(self.target), samples)
        # Answers over the time until the last one: a backlog answered late is not rate.
        answered = [s for s in samples if not s.error]
        span = max(seconds, max(s.scheduled_s + s.latency_s for s in answered))
        step["answered_rate"] = round(len(answered) / span, 2)
        self.log(f"    {rate:8.1f}/s: answered {step['answered_rate']}/s, p99 {step['p99_ms']} ms")
        return step

    def settle(self) -> None:
        """Waits out the backlog an overloaded step left (validate.py does the same)."""
        from cleave.bench.loadgen import settle

        settle(self.urls[0], self.bodies, self.base_ms)


def _by_role(target) -> dict[str, float]:
    """CPU seconds so far of the deployment's processes, summed per pool (schedstat's ns: a
    run of a few dozen requests is a few clock ticks of a router's time)."""
    used = dict.fromkeys(ROLES, 0.0)
    for role, seconds in target.cpu_seconds(fine=True).items():
        pool = next((p for p in ROLES if role.startswith(p[:-1])), None)
        if pool:
            used[pool] += seconds
    return used


def _per_request(before: dict, after: dict, samples) -> dict[str, float]:
    ok = sum(1 for s in samples if not s.error)
    if not ok:
        errors = sorted({str(s.error) for s in samples})[:3]
        raise UsageError(f"capped run: no request answered: {errors}")
    return {r: 1e3 * (after[r] - before[r]) / ok for r in ROLES}


def _factors(cpu_ms: dict, model: dict) -> dict:
    return {
        "cpu_ms": {r: round(v, 4) for r, v in cpu_ms.items()},
        # At least a tenth: a role whose ticks did not move over a short run is not free.
        "factor": {r: round(max(cpu_ms[r] / model[r], 0.1), 3) if model[r] else 1.0 for r in ROLES},
    }


def _p50(samples) -> float | None:
    ok = [s.latency_s * 1e3 for s in samples if not s.error]
    return round(float(np.median(ok)), 3) if ok else None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)
