"""The dense program against the machine: its achieved GFLOP/s at the request's batch size
(FLOPs counted from the program) next to the matrix-multiply peak measured in the same run,
for the same dtype and thread count, on the program's largest layer's shape."""

from __future__ import annotations

import time

import torch

from cleave.bundle.precision import convert, count_flops, input_quantization


def _best_seconds(fn, repeats: int, min_s: float = 0.3) -> float:
    """The fastest of `repeats` timed calls, after two untimed ones (first calls are slow);
    at least enough calls to span `min_s`."""
    fn()
    fn()
    best, spent, calls = float("inf"), 0.0, 0
    while calls < repeats or spent < min_s:
        t0 = time.perf_counter()
        fn()
        took = time.perf_counter() - t0
        best, spent, calls = min(best, took), spent + took, calls + 1
        if calls >= 50 * repeats:
            break
    return best


def largest_linear(module: torch.nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of the float32 program's largest constant linear weight."""
    best = None
    for node in getattr(module, "graph", torch.fx.Graph()).nodes:
        if node.op == "call_function" and node.target == torch.ops.aten.linear.default:
            weight = node.args[1]
            if weight.op == "get_attr":
                out_f, in_f = getattr(module, weight.target).shape
                if best is None or in_f * out_f > best[0] * best[1]:
                    best = (int(in_f), int(out_f))
    return best


def matmul_peak(dtype: str, rows: int, in_f: int, out_f: int) -> float:
    """GFLOP/s of one [rows, in_f] x [in_f, out_f] product on the current thread count, the
    way a `dtype` dense program multiplies (int8: FBGEMM's dynamic quantized linear)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_f, generator=gen)
    graph = _as_aten(torch.nn.Linear(in_f, out_f, bias=False))
    layers = [{"layer": 0, **input_quantization(float(x.min()), float(x.max()))}]
    program = convert(graph, dtype, layers if dtype == "int8" else None)
    with torch.inference_mode():
        seconds = _best_seconds(lambda: program(x), repeats=10)
    return 2.0 * rows * in_f * out_f / seconds / 1e9


def _as_aten(linear: torch.nn.Linear) -> torch.fx.GraphModule:
    """`linear` as a graph calling aten.linear on a constant weight, as exported programs do."""
    root = torch.nn.Module()
    root.register_buffer("weight", linear.weight.detach())
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    weight = graph.get_attr("weight")
    graph.output((graph.call_function(torch.ops.aten.linear.default, (x, weight)),))
    return torch.fx.GraphModule(root, graph)


def roofline(
    bundle, dense_inputs: list[torch.Tensor], threads: int, program=None, dtype: str | None = None
) -> dict:
    """The bundle's dense program at its dtype or `dtype` (or `program`, a compiled one) on
    `dense_inputs` (one request's) at `threads` torch threads, against the matmul peak for
    that dtype."""
    dtype = dtype or bundle.dense_dtype
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fp32 = bundle.dense_module("float32")
        # `is None`: a compiled module's truth value raises (it forwards len()).
        module = bundle.dense_module(dtype) if program is None else program
        flops = count_flops(fp32, dense_inputs)
        with torch.inference_mode():
            seconds = _best_seconds(lambda: module(*dense_inputs), repeats=5)
        rows = int(dense_inputs[0].shape[0]) if dense_inputs and dense_inputs[0].dim() else 1
        shape = largest_linear(fp32)
        peak = matmul_peak(dtype, rows, *shape) if shape else None
    finally:
        torch.set_num_threads(before)
    achieved = flops / seconds / 1e9
    return {
        "dtype": dtype,
        "threads": threads,
        "compiled": program is not None,
        "rows": rows,
        "gflop_per_request": flops / 1e9,
        "dense_ms": seconds * 1e3,
        "achieved_gflops": achieved,
        "matmul_shape": [rows, *shape] if shape else None,
        "peak_gflops": peak,
        "fraction_of_peak": achieved / peak if peak else None,
    }
