"""Builds a ranker from a bundle: the program it runs (at the bundle's dense dtype, compiled
or not, checked against the bundle's probe), its signature, executor and batcher."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from cleave.bundle.manifest import dtype_accuracy
from cleave.errors import BundleError, CleaveError, UsageError
from cleave.ranker import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, activation
from cleave.ranker import dense_dtype as dense_precision
from cleave.ranker.batcher import Batcher
from cleave.ranker.executor import DenseExecutor
from cleave.ranker.payload import KIND_RANK, KIND_RANK_FULL
from cleave.ranker.signature import signature

log = logging.getLogger("cleave.ranker")

# A float32 program may differ from the partitioned one by its sums' order once compiled.
FLOAT32_PROBE_TOLERANCE = 1e-4


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def default_compile_cache() -> Path:
    """Where compiled programs are kept across restarts: $XDG_CACHE_HOME/cleave/inductor."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cleave" / "inductor"


def compile_program(module: torch.nn.Module, cache_dir: str | os.PathLike | None):
    """TorchInductor compilation for the CPU: one program with a symbolic batch size (plus
    PyTorch's own specialization for batch 1), weights frozen into it, kept in `cache_dir` so
    a restart reuses the generated code. Compilation itself happens on the first calls, which
    the executor's warm-up makes before the ranker reports ready."""
    cache = Path(cache_dir) if cache_dir else default_compile_cache()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"compile cache {cache}: cannot be created: {err}") from None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    return torch.compile(module, dynamic=True, options={"freezing": True})


def check_probe(bundle, run, dtype: str) -> None:
    """Refuses to serve a program whose outputs on the bundle's probe batch are further from
    the float32 program's than the bundle's accuracy check allowed."""
    probe = bundle.probe()
    if probe is None:
        log.info("bundle has no probe batch (partitioned by an older cleave): not checked")
        return
    accuracy = dtype_accuracy(bundle.manifest, dtype)
    tolerance = accuracy.get("score_tolerance", FLOAT32_PROBE_TOLERANCE)
    try:
        got = run(probe["inputs"])
    except Exception as err:
        raise CleaveError(f"the {dtype} dense program failed on the probe batch: {err}") from err
    want = probe["outputs"]
    if len(got) != len(want):
        raise BundleError(f"probe: the program returned {len(got)} outputs, expected {len(want)}")
    worst = max(
        (
            float((g.double() - w.double()).abs().max())
            for g, w in zip(got, want, strict=True)
            if w.numel()
        ),
        default=0.0,
    )
    if not worst <= tolerance:  # NaN fails too
        raise CleaveError(
            f"the {dtype} dense program's outputs on the probe batch are {worst:.4g} from the "
            f"float32 program's, more than the bundle's tolerance {tolerance:g}: not served"
        )
    log.info("%s dense program checked on the probe batch: within %.3g", dtype, worst)


def load_ranker(
    bundle_dir,
    source,
    monolithic: bool = False,
    device: str = "auto",
    threads: int | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_wait_s: float = 0.0,
    cuda_graphs: bool = True,
    max_queue: int = DEFAULT_MAX_QUEUE,
    queue: str = "fifo",
    compile: bool = False,
    compile_cache: str | None = None,
    shared_batching: bool = True,
    eager_model: str = "",
    dense_dtype: str = "auto",
    measure_activation: bool = False,
) -> Batcher:
    """A batching loop over `source` (see cleave.ranker.batcher) for the bundle's dense program,
    or with `monolithic` for the whole model (lookups in PyTorch + the dense program).
    `shared_batching`: join requests of a shared-input model when the bundle has the batched
    program for it (cleave.partitioner.batched); otherwise such a model runs one per batch.
    `eager_model`: with `monolithic`, the saved original model run eagerly instead of the
    bundle's programs (cleave.ranker.eager). `dense_dtype`: the precision to serve, one the
    bundle approves, or "auto" (cleave.ranker.dense_dtype); the Batcher's `dense_choice` says
    which it is and how it was chosen. `measure_activation`: the Batcher's
    `activation_bytes` is then the program's memory per batch row here (cleave.ranker.activation),
    else None."""
    from cleave.bundle import load_bundle
    from cleave.bundle.precision import slow_reason

    # Tables are read only by the monolithic model; a dense ranker skips their checksums.
    # The dense modules come from the bundle's stored graphs (no torch.export.load: about 2 s
    # of CPU less per start); TorchInductor compiles the program as torch.export gives it.
    bundle = load_bundle(bundle_dir, verify=monolithic, stored_graphs=not compile)
    device = "cpu" if monolithic and device == "auto" else pick_device(device)
    if monolithic and device != "cpu":
        # The monolithic model looks rows up in host-memory tables with PyTorch's CPU kernels.
        raise UsageError(f"--monolithic runs on the CPU, not on {device!r}")
    if compile and device != "cpu":
        raise UsageError(f"--compile is for the CPU; on {device!r} the ranker replays CUDA graphs")
    if threads:  # before compiling and probing: both depend on the thread count
        torch.set_num_threads(threads)
    batched = shared_batching and not monolithic and bool(bundle.per_request_inputs)
    sig = signature(bundle.manifest, monolithic, batched)
    dense_sig = signature(bundle.manifest, False, batched)  # the probe times the dense program
    batch = lambda: dense_precision.probe_batch(bundle, dense_sig, max_batch)  # noqa: E731
    run = lambda module, inputs: _run_on(device, module, inputs)  # noqa: E731
    choice = dense_precision.settle(
        bundle.manifest,
        dense_dtype,
        device,
        lambda d: bundle.dense_module(d, batched=batched).to(device),
        batch,
        run,
    )
    dtype = choice.dtype
    bundle.keep_dense_modules(dtype)
    if dtype == "int8" and device != "cpu":
        raise UsageError(f"int8 dense programs run on the CPU (FBGEMM), not on {device!r}")
    reason = slow_reason(dtype, device)
    if reason:
        log.warning("%s", reason)
    dense = bundle.dense_module(dtype, batched=batched)
    if compile:
        compiled = compile_program(dense, compile_cache)
        try:
            if dense_precision.keep_compiled(choice, dense, compiled, batch, run):
                dense = compiled
        except Exception as err:
            raise CleaveError(f"the {dtype} dense program's compile failed: {err}") from err
    if eager_model:  # the saved model holds its tables: the bundle's are not decoded
        from cleave.ranker.eager import load_eager

        module = load_eager(eager_model, bundle.manifest)
    else:
        module = bundle.full_module(dense) if monolithic else dense
    executor = DenseExecutor(
        module, sig, device, threads, max_batch=max_batch, cuda_graphs=cuda_graphs
    )
    try:
        executor.warm_up()
    except Exception as err:
        what = "compile" if choice.compiled else "warm-up run"
        raise CleaveError(f"the {dtype} dense program's {what} failed: {err}") from err
    check_probe(bundle, lambda inputs: executor.run_module(dense, sig.join([inputs])), dtype)
    if bundle.per_request_inputs or not sig.batchable:
        log.info(
            "requests %s",
            "joined into batches" if sig.batchable else f"one per batch: {sig.why_not}",
        )
    kind = KIND_RANK_FULL if monolithic else KIND_RANK
    batcher = Batcher(
        source,
        executor,
        sig,
        kind,
        max_batch=max_batch,
        max_wait_s=max_wait_s,
        max_queue=max_queue,
        queue=queue,
    )
    batcher.dense_choice = choice
    if measure_activation:
        batcher.activation_bytes = activation.bytes_per_row(
            lambda rows: dense_precision.probe_batch(bundle, dense_sig, max_batch, rows),
            lambda inputs: executor.module(*inputs),
            executor.device.type,
            max_batch,
        )
        log.info("activation memory: %s bytes per batch row", batcher.activation_bytes)
    return batcher


def _run_on(device: str, module, inputs: list[torch.Tensor]) -> None:
    """One run of `module` on `device`, waited for (the dtype probe times it)."""
    with torch.inference_mode():
        outputs = module(*[t.to(device) for t in inputs])
    if device != "cpu":
        torch.cuda.synchronize()
    del outputs
