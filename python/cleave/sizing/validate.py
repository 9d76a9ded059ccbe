"""`cleave size --validate PLAN`: the sizing model checked against the system (docs/sizing.md,
"Validation"). PLAN is one `cleave size` wrote from a testbed catalog, so each host carries its
kind's CPU cap and link rate; it is served on the testbed (`cleave serve --runner testbed`,
the same code path as by hand) and loaded open-loop from the root namespace with requests of
the profile's shape: first at the rate it was sized for (its p99 there), then in rising steps
to the rate at which the p99 reaches the plan's target (its max rate). Predicted and measured
are printed and written side by side, with their ratios."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from cleave.errors import UsageError
from cleave.sizing.capped import crossing_rate, meets, summary

# Seconds of load per rate step: enough for STEP_SAMPLES requests (a p99 of fewer is its
# maximum), within these bounds; at the sized rate more, for its p99.
STEP_S, MAX_STEP_S, STEP_SAMPLES = 6.0, 15.0, 120
SIZED_S, MAX_SIZED_S, SIZED_SAMPLES = 10.0, 30.0, 200
QUICK_STEP_S, QUICK_SIZED_S = 1.0, 1.5
SIZING_PREFIX = "sizing: "  # the plan header's machine-readable line (cli.py writes it)
FIRST_STEP = 0.5  # of the predicted max rate
GROWTH = 1.25  # each step's rate over the last's, until one misses
MAX_STEPS, BISECTIONS = 9, 2
BODIES = 16  # distinct requests, cycled
SEARCH_BUDGET_S = 170.0  # from the start, the search steps no more (bounded: ~3 min a plan)


def read_sizing(path: Path) -> dict:
    """The `sizing:` line of the plan's header (cli.py writes it); a clear error when the
    plan has none (not written by `cleave size`) or it is not a testbed plan."""

    if not path.is_file():
        raise UsageError(f"--validate {path}: no such plan file")
    sizing = None
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break  # the header is the leading comment lines
        text = line.lstrip("#").strip()
        if text.startswith(SIZING_PREFIX):
            try:
                sizing = json.loads(text[len(SIZING_PREFIX) :])
            except json.JSONDecodeError as err:
                raise UsageError(
                    f"--validate {path}: its `sizing:` header line is broken: {err}"
                ) from None
            break
    if not isinstance(sizing, dict):
        raise UsageError(
            f"--validate {path}: this plan was not written by `cleave size` (its header has no "
            f"`# {SIZING_PREFIX}...` line with the predicted p99 and max rate); size one with "
            f"`cleave size BUNDLE --rate R --p99-ms L --catalog deploy/catalogs/testbed.yaml -o "
            f"PLAN.yaml`"
        )
    if not sizing.get("testbed"):
        raise UsageError(
            f"--validate {path}: sized with catalog {sizing.get('catalog')!r}, whose kinds are "
            f"not the testbed's (no `testbed: true`): its hosts cannot be emulated here; size "
            f"it with deploy/catalogs/testbed.yaml"
        )
    return sizing


def validate(path: Path, quick: bool = False, log=print) -> dict:
    from cleave.bench.harness.target import Target
    from cleave.bench.loadgen import binary_infer_body
    from cleave.bundle import manifest as manifest_io
    from cleave.plan.files import load_plan
    from cleave.runners.testbed import host_limits
    from cleave.sizing.router import synthetic_inputs

    path = Path(path)
    sizing = read_sizing(path)
    plan = load_plan(path)
    host_limits(plan)  # refuses caps that leave no core to the load generator
    bundle = (path.parent / plan.bundle).resolve()
    manifest = manifest_io.read(bundle, whole=False)
    rng = np.random.default_rng(0)
    bodies = [
        binary_infer_body(
            synthetic_inputs(manifest, sizing["candidates"], sizing["ids_per_candidate"], rng)
        )
        for _ in range(BODIES)
    ]
    goal, rate, predicted = sizing["p99_ms"], sizing["rate"], sizing["predicted_max_rate"]
    if quick:
        step_s, sized_s = QUICK_STEP_S, QUICK_SIZED_S
    else:
        step_s = min(MAX_STEP_S, max(STEP_S, STEP_SAMPLES / (FIRST_STEP * predicted)))
        sized_s = min(MAX_SIZED_S, max(SIZED_S, SIZED_SAMPLES / rate))
    started = time.monotonic()
    target = Target(plan=path, flags=["--runner", "testbed"])
    with target:
        urls = [f"{u}/v2/models/{plan.name}/infer" for u in target.urls]
        prober = _Prober(target, urls, bodies, goal, step_s, log)
        at_sized = prober.probe(rate, sized_s, sized=True)
        highest = prober.search(predicted, quick, started)
        searched = [st for st in prober.steps if not st["at_sized_rate"]]
        # Where the steps' p99 crosses the target, between the last within and the first
        # over it, as the profile's calibration finds it (capped.crossing_rate); the highest
        # step within where they did not cross it.
        crossed = crossing_rate(searched, goal)
        measured = round(crossed, 1) if crossed is not None else highest
        cpu = at_sized.pop("cpu_ms_by_role", {})
    result = {
        "plan": str(path),
        "model": plan.name,
        "catalog": sizing.get("catalog"),
        "hosts": {p: v["hosts"] for p, v in sizing.get("pools", {}).items()},
        "kinds": {p: v["kind"] for p, v in sizing.get("pools", {}).items()},
        "sized_rate": rate,
        "p99_target_ms": goal,
        "predicted_p99_ms": sizing["predicted_p99_ms"],
        "predicted_max_rate": predicted,
        "measured_max_rate": measured,
        "highest_rate_within": highest,
        "max_rate_ratio": _ratio(measured, predicted),
        "p99_ms_at_sized_rate": at_sized["p99_ms"],
        "p99_ratio_at_sized_rate": _ratio(at_sized["p99_ms"], sizing["predicted_p99_ms"]),
        "meets_p99_at_sized_rate": at_sized["within"],
        "errors_at_sized_rate": at_sized["errors"],
        "cpu_ms_per_request_by_role": cpu,
        "predicted_service_ms": {p: v["service_ms"] for p, v in sizing.get("pools", {}).items()},
        "steps": prober.steps,
        "seconds": round(time.monotonic() - started, 1),
    }
    return result


class _Prober:
    def __init__(self, target, urls, bodies, goal_ms, step_s, log):
        self.target, self.urls, self.bodies = target, urls, bodies
        self.goal, self.step_s, self.log = goal_ms, step_s, log
        self.steps: list[dict] = []
        self.base_ms = self._warm_up()

    def _warm_up(self) -> float:
        from cleave.bench.loadgen import sequential

        got = sequential(self.urls[0], self.bodies, 20, timeout_s=30.0)
        ok = [s.latency_s * 1e3 for s in got if not s.error]
        if not ok:
            errors = sorted({s.error for s in got})
            raise UsageError(f"the served plan answered no request: {errors}")
        return float(np.median(ok))

    def probe(self, rate: float, seconds: float, sized: bool = False) -> dict:
        from cleave.bench.loadgen import open_loop_spread

        cpu = self.target.cpu_seconds() if sized else {}
        samples = open_loop_spread(self.urls, self.bodies, rate, seconds, seed=int(rate))
        point = summary(samples, rate)
        errors, within = point["errors"], meets(point, self.goal)
        point.update(within=within, at_sized_rate=sized)
        answered = point["sent"] - errors
        if sized and answered:  # which role spends what: where the model's service times miss
            after = self.target.cpu_seconds()
            point["cpu_ms_by_role"] = {
                r: round(1e3 * (after[r] - cpu.get(r, 0.0)) / answered, 3) for r in sorted(after)
            }
        self.steps.append(point)
        self.log(
            f"  {rate:8.1f}/s: p50 {point['p50_ms']} ms, p99 {point['p99_ms']} ms, errors "
            f"{errors}/{len(samples)} ({'within' if within else 'over'} {self.goal:g} ms)"
        )
        if not within:
            self._drain()
        return point

    def _drain(self) -> None:
        """Wait out the backlog a missed step left (requests queued in the routers)."""
        from cleave.bench.loadgen import settle

        settle(self.urls[0], self.bodies, self.base_ms)

    def search(self, predicted: float, quick: bool, started: float) -> float:
        """The highest rate whose p99 stays within the target: steps from FIRST_STEP of the
        prediction up by GROWTH (down, if the first misses), then bisection."""
        lo, hi, rate = 0.0, None, max(1.0, FIRST_STEP * predicted)
        steps = 3 if quick else MAX_STEPS
        for _ in range(steps):
            if time.monotonic() - started > SEARCH_BUDGET_S:
                break
            if self.probe(rate, self.step_s)["within"]:
                lo = rate
                if hi is not None:
                    break
                rate *= GROWTH
            else:
                hi = rate
                if lo:
                    break
                rate /= GROWTH * GROWTH
        for _ in range(0 if quick else BISECTIONS):
            if hi is None or not lo or time.monotonic() - started > SEARCH_BUDGET_S:
                break
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.probe(mid, self.step_s)["within"] else (lo, mid)
        return round(lo, 1)


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def print_validation(r: dict) -> None:
    print(
        f"validated {r['plan']}: max rate predicted {r['predicted_max_rate']:.0f}/s, measured "
        f"{r['measured_max_rate']:.0f}/s (x{r['max_rate_ratio']}); at the sized "
        f"{r['sized_rate']:g}/s p99 predicted {r['predicted_p99_ms']:.1f} ms, measured "
        f"{r['p99_ms_at_sized_rate']} ms (target {r['p99_target_ms']:g} ms: "
        f"{'met' if r['meets_p99_at_sized_rate'] else 'MISSED'}); {r['seconds']:.0f} s"
    )


def run_validate(path: Path, json_path: str | None, quick: bool = False) -> int:
    import sys

    result = validate(path, quick, log=lambda m: print(m, file=sys.stderr, flush=True))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}))
    print_validation(result)
    return 0
