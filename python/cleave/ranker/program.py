"""Builds a ranker from a bundle: the program it runs, its signature, executor and batcher."""

from __future__ import annotations

import torch

from cleave.errors import UsageError
from cleave.ranker import DEFAULT_MAX_QUEUE
from cleave.ranker.batcher import Batcher
from cleave.ranker.executor import DenseExecutor
from cleave.ranker.payload import KIND_RANK, KIND_RANK_FULL
from cleave.ranker.signature import signature


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_ranker(
    bundle_dir,
    source,
    monolithic: bool = False,
    device: str = "auto",
    threads: int | None = None,
    max_batch: int = 256,
    max_wait_s: float = 0.0,
    cuda_graphs: bool = True,
    max_queue: int = DEFAULT_MAX_QUEUE,
) -> Batcher:
    """A batching loop over `source` (see cleave.ranker.batcher) for the bundle's dense program,
    or with `monolithic` for the whole model (lookups in PyTorch + the dense program)."""
    from cleave.bundle import load_bundle

    # Tables are read only by the monolithic model; a dense ranker skips their checksums.
    bundle = load_bundle(bundle_dir, verify=monolithic)
    device = "cpu" if monolithic and device == "auto" else pick_device(device)
    if monolithic and device != "cpu":
        # The monolithic model looks rows up in host-memory tables with PyTorch's CPU kernels.
        raise UsageError(f"--monolithic runs on the CPU, not on {device!r}")
    module = bundle.full_module() if monolithic else bundle.dense_module()
    sig = signature(bundle.manifest, monolithic)
    executor = DenseExecutor(
        module, sig, device, threads, max_batch=max_batch, cuda_graphs=cuda_graphs
    )
    executor.warm_up()
    kind = KIND_RANK_FULL if monolithic else KIND_RANK
    return Batcher(
        source,
        executor,
        sig,
        kind,
        max_batch=max_batch,
        max_wait_s=max_wait_s,
        max_queue=max_queue,
    )
