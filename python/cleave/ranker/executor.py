"""The dense executor: runs one batch as one fused sequence on CPU threads or on a GPU.

On CUDA, batches whose inputs all carry the batch dimension (joined per-request inputs too)
are padded up to a bucket size (powers of two up to max_batch) and replayed from a CUDA graph
captured once per bucket, so a batch is one graph launch instead of one launch per operator.
Other batches run eagerly.
"""

from __future__ import annotations

import logging

import torch

from cleave.ranker import DEFAULT_MAX_BATCH
from cleave.ranker.signature import Signature

log = logging.getLogger("cleave.ranker")


def _flat(outputs) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    flat = []
    for out in outputs:
        flat.extend(_flat(out) if isinstance(out, (list, tuple)) else [out])
    return flat


class DenseExecutor:
    """Runs `module(*inputs)` and returns its flat outputs as CPU tensors."""

    def __init__(
        self,
        module: torch.nn.Module,
        signature: Signature,
        device: str = "cpu",
        threads: int | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        cuda_graphs: bool = True,
    ):
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda asked for, but torch.cuda.is_available() is False")
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        self.module = module.to(self.device) if self.device.type != "cpu" else module
        self.signature = signature
        self.graphs: dict[int, _Graph] = {}
        self.graphless: set[int] = set()  # buckets whose capture failed
        self.use_graphs = (
            cuda_graphs
            and self.device.type == "cuda"
            and signature.batchable
            and all(spec.join in ("batch", "expand") for spec in signature.inputs)
        )
        self.buckets = _buckets(max_batch) if self.use_graphs else []

    def warm_up(self) -> None:
        """Runs the program once before serving (first calls are slow) and, on CUDA, captures
        every bucket's graph, so no request pays for it."""
        example = self.signature.example(1)
        if example is None:
            return
        self.run(example)
        if self.device.type == "cpu":  # a compiled program specializes batch 1: compile both
            self.run(self.signature.example(2))
        for bucket in self.buckets:
            batch = self.signature.example(bucket)
            if batch is not None:
                self.run(batch)

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.inference_mode():
            if self.device.type == "cpu":
                return _flat(self.module(*inputs))
            rows = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 0
            bucket = next((b for b in self.buckets if b >= rows), None)
            if bucket is not None and bucket not in self.graphless:
                graph = self.graphs.get(bucket)
                if graph is None:
                    try:
                        graph = _Graph(self.module, inputs, bucket, self.device)
                    except Exception as err:  # e.g. a host sync in the program: run eagerly
                        log.warning("no CUDA graph for batch bucket %d: %s", bucket, err)
                        self.graphless.add(bucket)
                        return self._eager(inputs)
                    self.graphs[bucket] = graph
                return graph.replay(inputs, rows)
            return self._eager(inputs)

    def run_module(self, module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """`module` (on this executor's device) run eagerly on `inputs`: CPU outputs."""
        with torch.inference_mode():
            moved = [t.to(self.device) for t in inputs]
            return [t.to("cpu") for t in _flat(module(*moved))]

    def _eager(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        moved = [t.to(self.device, non_blocking=True) for t in inputs]
        return [t.to("cpu") for t in _flat(self.module(*moved))]


def _buckets(max_batch: int) -> list[int]:
    buckets, size = [], 1
    while size < max_batch:
        buckets.append(size)
        size *= 2
    buckets.append(max_batch)
    return buckets


class _Graph:
    """One CUDA graph for batches of up to `bucket` rows, with static input/output buffers."""

    def __init__(self, module, example: list[torch.Tensor], bucket: int, device: torch.device):
        self.inputs = [
            torch.zeros((bucket, *t.shape[1:]), dtype=t.dtype, device=device) for t in example
        ]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph, as CUDA graphs require
            for _ in range(2):
                module(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = _flat(module(*self.inputs))

    def replay(self, inputs: list[torch.Tensor], rows: int) -> list[torch.Tensor]:
        for buf, t in zip(self.inputs, inputs, strict=True):
            buf[:rows].copy_(t, non_blocking=True)
            buf[rows:].zero_()  # padding rows: finite values, results discarded
        self.graph.replay()
        return [out[:rows].to("cpu") for out in self.outputs]
