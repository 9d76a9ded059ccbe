"""Which precision a ranker serves its dense program at (docs/bundle.md, "Dense precision"):
the one asked for (`--dense-dtype`, one the bundle approves), the bundle's only one, or, when
the bundle approves several, the fastest of them here: measured at start by a short probe of
each on the ranker's own device and threads, at the bundle's typical batch size. A deployment
serves one dtype on every ranker: the first one's (cleave/runners/roles.py, rankers_choose)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cleave.bundle.manifest import served_dtypes
from cleave.errors import UsageError
from cleave.settings.choices import DENSE_DTYPES

if TYPE_CHECKING:
    import torch

log = logging.getLogger("cleave.ranker")

PROBE_BUDGET_S = 2.0  # the whole probe, every dtype together (at least one timed run each)
PROBE_RUNS = 3  # timed batches per dtype at most, after one warm-up run
# A less precise dtype is chosen over a more precise one only when it is this much faster:
# closer than that the probe's noise would decide, and the more precise program is safer.
MARGIN = 0.05


@dataclass
class DenseChoice:
    """What a ranker serves and why: `chosen_by` "flag" (asked for), "bundle" (the only one
    it approves) or "probe" (the fastest here); `seconds`: the probe's time per batch of
    `rows` rows, per dtype probed."""

    dtype: str
    chosen_by: str
    seconds: dict[str, float] = field(default_factory=dict)
    rows: int = 0
    # With --compile: whether the compiled program is served (`keep_compiled`), and the
    # probe's time per batch of each ("eager", "compiled"); None without --compile.
    compiled: bool | None = None
    compile_seconds: dict[str, float] = field(default_factory=dict)


def choose(seconds: dict[str, float]) -> str:
    """The dtype to serve from each one's measured time per batch: the fastest, or a more
    precise one within MARGIN of it."""
    if not seconds:
        raise ValueError("no dense dtype was measured")
    best = min(seconds.values())
    return next(d for d in DENSE_DTYPES if d in seconds and seconds[d] <= best * (1 + MARGIN))


def candidates(manifest: dict, asked: str, device: str) -> list[str]:
    """The dtypes this ranker may serve: the one asked for (UsageError when the bundle does
    not approve it; float32, the program as partitioned, always may be), else those the
    bundle approves that run on `device`."""
    allowed = served_dtypes(manifest)
    if asked != "auto":
        if asked not in allowed and asked != "float32":
            raise UsageError(
                f"--dense-dtype {asked}: the bundle approves {', '.join(allowed)} (partition "
                f"with --dense-dtypes listing {asked} to have it checked and approved)"
            )
        return [asked]
    runnable = [d for d in allowed if device == "cpu" or d != "int8"]  # int8 is FBGEMM's
    return runnable or allowed  # int8 alone on a GPU: refused with its reason later


def settle(manifest: dict, asked: str, device: str, modules, batch, run) -> DenseChoice:
    """The DenseChoice for this ranker. With several candidates, `modules(dtype)` gives each
    one's program, timed by `run(module, inputs)` on the `(inputs, rows)` that `batch()`
    gives (None: no batch to time)."""
    options = candidates(manifest, asked, device)
    timed = batch() if len(options) > 1 else None
    if len(options) == 1:
        choice = DenseChoice(options[0], "flag" if asked != "auto" else "bundle")
    elif timed is None:  # no batch to time (a symbolic size): the most precise
        choice = DenseChoice(options[0], "bundle")
    else:
        seconds = probe({d: modules(d) for d in options}, timed[0], run)
        choice = DenseChoice(choose(seconds), "probe", seconds, timed[1])
    log.info("%s", describe(choice))
    return choice


def describe(choice: DenseChoice) -> str:
    """The log line: `dense dtype int8 (chosen by probe: float32 41.20 ms, ...)`."""
    times = ", ".join(f"{d} {s * 1e3:.2f} ms" for d, s in choice.seconds.items())
    measured = f": {times} per batch of {choice.rows} rows" if times else ""
    return f"dense dtype {choice.dtype} (chosen by {choice.chosen_by}{measured})"


def keep_compiled(choice: DenseChoice, eager, compiled, batch, run) -> bool:
    """Whether `compiled` (torch.compile of `eager`) is served: unless it is measured slower
    than `eager` by more than MARGIN on `batch()`'s inputs, each timed by `run(module,
    inputs)` as the dtype probe times them. Compiling does not pay on every program and CPU:
    an int8 program breaks into a graph per layer around FBGEMM's packed weights, which
    TorchDynamo cannot trace, and ran 1.11-1.13x slower than eager (docs/benchmarks.md). Records
    the decision and times on `choice`."""
    timed = batch()
    if timed is not None:
        run(compiled, timed[0])  # compiles, outside the probe's time budget
        choice.compile_seconds = probe({"eager": eager, "compiled": compiled}, timed[0], run)
    seconds = choice.compile_seconds
    choice.compiled = not seconds or seconds["compiled"] <= seconds["eager"] * (1 + MARGIN)
    times = ", ".join(f"{name} {s * 1e3:.2f} ms" for name, s in seconds.items())
    if choice.compiled:
        log.info("dense program compiled%s", f" ({times} per batch)" if times else "")
    else:
        log.warning("dense program served uncompiled: compiled is slower here (%s)", times)
    return choice.compiled


def probe(modules: dict, inputs: list[torch.Tensor], run) -> dict[str, float]:
    """Each module's fastest of up to PROBE_RUNS timed runs on `inputs` after a warm-up, each
    dtype stopping once past its share of PROBE_BUDGET_S."""
    share = PROBE_BUDGET_S / max(1, len(modules))
    seconds = {}
    for dtype, module in modules.items():
        start = time.perf_counter()
        run(module, inputs)  # first calls pay for allocation and packing
        best = math.inf
        for _ in range(PROBE_RUNS):
            if best < math.inf and time.perf_counter() - start > share:
                break
            t0 = time.perf_counter()
            run(module, inputs)
            best = min(best, time.perf_counter() - t0)
        seconds[dtype] = best
    return seconds


def probe_batch(
    bundle, sig, max_batch: int, rows: int = 0
) -> tuple[list[torch.Tensor], int] | None:
    """(inputs, rows): the bundle's probe request joined to `rows` rows, by default its
    typical batch size (the rows its dense demand was timed at, at most `max_batch`), or zeros
    of that many rows."""
    demand = int((bundle.manifest["dense"].get("demand") or {}).get("batch", 100))
    rows = rows or min(max_batch, demand)
    recorded = bundle.probe()
    if recorded is not None:
        one = sig.rows(recorded["inputs"])
        copies = max(1, math.ceil(rows / max(1, one))) if sig.batchable else 1
        return sig.join([recorded["inputs"]] * copies), one * copies
    example = sig.example(rows)
    return None if example is None else (example, rows)
