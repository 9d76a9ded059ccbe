"""What each role spends per request on a capped testbed host (docs/sizing.md, "Capped hosts").

A share of a core is not that share of a core's speed: on a tenth of a core the routers of
the validation runs spent 2.4-2.9x and the rankers 1.2-2.8x the CPU per request the profile
measured on a whole core (a request that finds its group's quota spent waits for the next
period and runs cold; TCP over a veth pays the receiver's softirq in the sender's context),
while a ranker that is the bottleneck joins queued requests into one batch and spends less.
So for each kind of a testbed catalog, `cleave profile --capped CATALOG` serves the bundle on
the testbed with one router, two shard hosts and one ranker, each on a host of that kind (its
CPU cap and link), and measures every role's CPU per request one request at a time (what a
request sees: its own time) and at open-loop steps up past what the deployment answers (what
a pool costs when it is the bottleneck, with as much queueing as each step's p99 shows:
`cleave size` picks the step its target allows), and how the steps' p99 waits compare with
the queueing model's. Each CPU figure is kept as a factor over what the
whole-core profile says that role costs, so `cleave size` applies it to any dtype, batch
size and host count of that kind."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np

from cleave.errors import UsageError

ROLES = ("routers", "shards", "rankers")
SEQUENTIAL, QUICK_SEQUENTIAL = 40, 8  # requests one at a time (low load)
CLOSED_S, QUICK_CLOSED_S = 4.0, 1.0  # seconds of closed-loop load: the steps' scale
CLIENTS = 8  # closed-loop clients: enough to keep every role of one path busy
# Open-loop steps, as shares of the closed-loop rate: seconds enough for STEP_SAMPLES
# requests within these bounds. The last is past what the deployment answers.
STEPS, QUICK_STEPS = (0.35, 0.6, 0.8, 1.0, 1.25, 1.6), (0.5, 1.6)
STEP_S, MAX_STEP_S, STEP_SAMPLES = 3.0, 12.0, 40
BODIES = 16
MIN_WAIT_SCALE, MAX_WAIT_SCALE = 0.25, 20.0  # a fit outside says the model is broken, not slow
SHARD_HOSTS = 2  # the fewest a plan has (two replicas of every row)
# The calibration plan's target: it keeps the routers' default budget (1 s: plan.write_plan
# writes twice the target when that is more). With a 4 s budget the overload steps queued
# longer, the ranker's batches grew, and the saturated figure overstated what plans serving
# at a p99 target get (dlrm: 0.56 of the prediction, against 0.66-1.04).
CALIBRATION_P99_MS = 500.0


def measure_capped(bundle_dir: Path, profile: dict, catalog: str, quick: bool, log) -> dict:
    """{kind: {cores, link_gbit, low, saturated, ...}} for every kind of the testbed
    catalog: each role's CPU ms per request and its factor over the profile's."""
    from cleave.bundle import manifest as manifest_io

    kinds = testbed_kinds(catalog)
    manifest = manifest_io.read(bundle_dir, whole=False)
    out = {}
    with tempfile.TemporaryDirectory(prefix="cleave-capped-") as tmp:
        for kind in kinds:
            log(f"profile: capped hosts of kind {kind.kind} ({kind.cpus * kind.cpu_speed:g} core)")
            plan = Path(tmp) / f"{kind.kind}.yaml"
            model = _write_plan(bundle_dir, manifest, profile, kind, catalog, plan)
            measured = _serve_and_measure(plan, manifest, profile, kind, model, quick, log)
            measured["wait_scale"] = wait_scale(manifest, profile, kind, measured)
            out[kind.kind] = measured
    return out


def wait_scale(manifest: dict, profile: dict, kind, measured: dict) -> float:
    """How much longer than the queueing model's the measured wait was: the least-squares
    factor on the model's p99 wait (the model's own pools for the measured deployment, with
    these hosts' CPU figures) that best fits each step's p99 beyond its service times. On a
    capped host a request that finds the group's quota spent waits for the next period, and
    a batching ranker serves the requests that queued behind a batch only after it: M/M/c
    leaves both out. 1 when no step was below the model's capacity."""
    from cleave.sizing.search import Sizer, Target

    trial = {**profile, "capped": {kind.kind: {**measured, "wait_scale": 1.0}}}
    sizer = Sizer(manifest, trial, [kind], Target(1.0, 1e9))
    dtype = default_dtype(profile)
    pools = [sizer.routers(kind), sizer.shards(kind, SHARD_HOSTS), sizer.rankers(kind, dtype, 1)]
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
    from cleave.sizing.catalog import is_testbed, load_catalog

    kinds = load_catalog(catalog)
    if not is_testbed(read_yaml(catalog, "catalog"), str(catalog)):
        raise UsageError(
            f"--capped {catalog}: not a testbed catalog (no `testbed: true` at its top): only "
            f"the testbed's own hosts can be measured here"
        )
    return kinds


def model_cpu_ms(sizer, profile: dict) -> dict[str, float]:
    """What the whole-core profile says each role spends on one request of the calibration
    deployment (one router, SHARD_HOSTS range groups, one float32 ranker of one thread)."""
    from cleave.sizing.search import dense_ms

    dtype = default_dtype(profile)
    return {
        "routers": sizer.router_us / 1e3,
        "shards": (SHARD_HOSTS * sizer.shard_call_us + sizer.ids * sizer.shard_ns_per_id / 1e3)
        / 1e3,
        "rankers": dense_ms(profile, dtype, 1, sizer.candidates) + sizer.ranker_overhead_ms,
    }


def default_dtype(profile: dict) -> str:
    dense = profile["dense"]
    return "float32" if "float32" in dense else next(iter(dense))


def _write_plan(bundle_dir, manifest, profile, kind, catalog, path: Path) -> dict:
    from cleave.sizing.plan import write_plan
    from cleave.sizing.search import Mix, Sizer, Target, _option

    target = Target(1.0, CALIBRATION_P99_MS)
    sizer = Sizer(manifest, profile, [kind], target)
    dtype = default_dtype(profile)
    pools = [sizer.routers(kind), sizer.shards(kind, SHARD_HOSTS), sizer.rankers(kind, dtype, 1)]
    mix = Mix(pools, sizer.fixed_ms(pools))
    result = {
        "target": {"rate": 1.0, "p99_ms": CALIBRATION_P99_MS, "candidates": sizer.candidates},
        "chosen": {**mix.describe(target), **_option((kind, kind, kind, dtype, 1, None))},
        "catalog": {"path": str(catalog), "testbed": True},
        "traffic": dict(profile["traffic"]),
    }
    write_plan(bundle_dir, mix, result, path)
    return model_cpu_ms(sizer, profile)


def _serve_and_measure(plan, manifest, profile, kind, model: dict, quick: bool, log) -> dict:
    from cleave.bench.harness.target import Target
    from cleave.bench.loadgen import binary_infer_body, closed_loop, sequential
    from cleave.plan.files import load_plan
    from cleave.sizing.router import synthetic_inputs

    traffic = profile["traffic"]
    rng = np.random.default_rng(1)
    bodies = [
        binary_infer_body(
            synthetic_inputs(manifest, traffic["candidates"], traffic["ids_per_candidate"], rng)
        )
        for _ in range(BODIES)
    ]
    count = QUICK_SEQUENTIAL if quick else SEQUENTIAL
    name = load_plan(plan).name
    with Target(plan=plan, flags=["--runner", "testbed"]) as target:
        url = f"{target.urls[0]}/v2/models/{name}/infer"
        warm = sequential(url, bodies, BODIES, timeout_s=30.0)
        if not any(not s.error for s in warm):
            raise UsageError(f"capped {kind.kind}: the deployment answered no request: {warm[0]}")
        before = _by_role(target)
        low = sequential(url, bodies, count, timeout_s=30.0)
        low_cpu = _per_request(before, _by_role(target), low)
        closed_s = QUICK_CLOSED_S if quick else CLOSED_S
        closed = closed_loop(url, bodies, CLIENTS, closed_s, timeout_s=30.0)
        closed_rate = sum(1 for s in closed if not s.error) / closed_s
        steps = _steps(target, url, bodies, closed_rate, quick, log)
    if not steps:
        raise UsageError(f"capped {kind.kind}: every request of the first step was refused")
    cores = kind.cpus * kind.cpu_speed
    # The most a deployment of these hosts answered: its bottleneck's capacity, batches as
    # large as a queue under overload makes them.
    top = max(steps, key=lambda st: st["answered_rate"])
    busy_cpu = top["cpu_ms"]
    for st in steps:  # each step's CPU as factors too: cleave size picks one by its target
        st.update(_factors(st["cpu_ms"], model))
    result = {
        "cores": cores,
        "link_gbit": kind.nic_gbit,
        "model_cpu_ms": {r: round(v, 4) for r, v in model.items()},
        "low": _factors(low_cpu, model),
        "saturated": _factors(busy_cpu, model),
        # How busy each role was there (CPU seconds over wall over its cap): the pool near 1
        # is the bottleneck, whose saturated figure is a capacity.
        "saturated_utilization": {
            r: round(busy_cpu[r] * top["answered_rate"] / 1e3 / (cores * _hosts(r)), 3)
            for r in busy_cpu
        },
        "saturated_rate": top["answered_rate"],
        "closed_loop_rate": round(closed_rate, 2),
        "low_p50_ms": _p50(low),
        "steps": steps,
    }
    log(
        f"  {kind.kind}: low load {result['low']['cpu_ms']} ms CPU per request, saturated "
        f"{result['saturated']['cpu_ms']} at {result['saturated_rate']}/s"
    )
    return result


def _steps(target, url, bodies, closed_rate: float, quick: bool, log) -> list[dict]:
    """Open-loop steps at fractions of the closed-loop rate, up past it (a queue that grows
    makes a ranker's batches larger, so it answers more than eight clients let it): each
    step's p99, the rate answered and every role's CPU per answered request."""
    from cleave.bench.loadgen import open_loop

    steps = []
    for i, share in enumerate(QUICK_STEPS if quick else STEPS):
        rate = max(0.5, share * closed_rate)
        seconds = 1.0 if quick else min(MAX_STEP_S, max(STEP_S, STEP_SAMPLES / rate))
        before = _by_role(target)
        samples = open_loop(url, bodies, rate, seconds, timeout_s=30.0, seed=i)
        ok = [s.latency_s * 1e3 for s in samples if not s.error]
        if not ok:  # all refused: past what it answers, nothing to measure
            break
        cpu = _per_request(before, _by_role(target), samples)
        # Answers over the time until the last one: a backlog answered late is not rate.
        span = max(seconds, max(s.scheduled_s + s.latency_s for s in samples if not s.error))
        step = {
            "rate": round(rate, 2),
            "sent": len(samples),
            "errors": len(samples) - len(ok),
            "answered_rate": round(len(ok) / span, 2),
            "p50_ms": round(float(np.percentile(ok, 50)), 3),
            "p99_ms": round(float(np.percentile(ok, 99)), 3),
            "cpu_ms": cpu,
        }
        steps.append(step)
        log(f"    {rate:8.1f}/s: answered {step['answered_rate']}/s, p99 {step['p99_ms']} ms")
    return steps


def _hosts(role: str) -> int:
    return SHARD_HOSTS if role == "shards" else 1


def _by_role(target) -> dict[str, float]:
    """CPU seconds so far of the deployment's processes, summed per pool (schedstat's ns: a
    run of a few dozen requests is a few clock ticks of a router's time)."""
    from cleave.bench.harness.processes import cpu_ns, process_tree

    used = dict.fromkeys(ROLES, 0.0)
    for pid, role in process_tree(target.server.proc.pid).items():
        pool = next((p for p in ROLES if role.startswith(p[:-1])), None)
        if pool:
            try:
                used[pool] += cpu_ns(pid) / 1e9
            except OSError:  # gone meanwhile
                continue
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
