"""The dense program's precision, a bundle property (`cleave partition --dense-dtype`).

A bundle keeps its dense program in float32; `convert` derives the program that is served from
it, deterministically, so the partitioner's accuracy measurement holds for every ranker that
loads the bundle (docs/bundle.md, "Dense precision"):

* bfloat16: weights and floating activations in bfloat16, inputs cast on the way in and
  outputs back to float32 on the way out (oneDNN's AVX512-BF16/AMX kernels);
* int8: the linear layers with a constant weight that the partitioner chose (those whose
  quantization keeps the accuracy within limits) in int8 (weights per output channel, inputs
  with a scale calibrated on the labelled set; FBGEMM's VNNI kernels), the other linear
  layers in bfloat16, everything else float32.
"""

from __future__ import annotations

import copy
import functools
import warnings

import torch
from torch import fx

from cleave.errors import UsageError
from cleave.settings.choices import DENSE_DTYPES

# The CPU feature flags (/proc/cpuinfo) that make each reduced precision fast.
FAST_ON = {"bfloat16": ("avx512_bf16", "amx_bf16"), "int8": ("avx512_vnni", "avx_vnni", "amx_int8")}


def check_dtype(dtype: str) -> str:
    if dtype not in DENSE_DTYPES:
        raise UsageError(f"dense dtype must be {DENSE_DTYPES.expected()}, got {dtype!r}")
    return dtype


def check_dtypes(dtypes) -> list[str]:
    """A list of dense dtypes (or "a,b,c"), each known and named once."""
    if isinstance(dtypes, str):
        dtypes = [d.strip() for d in dtypes.split(",")]
    dtypes = list(dtypes)
    if not dtypes or any(d == "" for d in dtypes):
        raise UsageError(
            f"dense dtypes: expected a comma-separated list of {DENSE_DTYPES.expected()}, "
            f"got {','.join(dtypes)!r}"
        )
    for d in dtypes:
        if d not in DENSE_DTYPES:
            raise UsageError(f"dense dtypes: each must be {DENSE_DTYPES.expected()}, got {d!r}")
    twice = sorted({d for d in dtypes if dtypes.count(d) > 1})
    if twice:
        raise UsageError(f"dense dtypes: each may be listed once, got {', '.join(twice)} twice")
    return dtypes


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def slow_reason(dtype: str, device: str = "cpu") -> str | None:
    """Why `dtype` would be slow on this machine's CPU, or None."""
    if device != "cpu" or dtype not in FAST_ON:
        return None
    flags = cpu_flags()
    # An int8 program runs the layers it does not quantize in bfloat16.
    for needed in (dtype, "bfloat16") if dtype == "int8" else (dtype,):
        if flags and not any(f in flags for f in FAST_ON[needed]):
            return (
                f"this CPU has none of {', '.join(FAST_ON[needed])}: the {dtype} dense "
                f"program's {needed} layers are emulated and may be slower than float32"
            )
    return None


def convert(
    module: torch.nn.Module, dtype: str, int8_layers: list[dict] | None = None
) -> torch.nn.Module:
    """The program to serve at `dtype`, from the bundle's float32 dense module (not modified).
    For int8, `int8_layers` are the layers quantized ({"layer": index among the linear layers
    with constant weights in graph order, "scale", "zero_point" of its input}, from
    `calibrate`); the other linear layers run in bfloat16."""
    check_dtype(dtype)
    if dtype == "float32":
        return module
    if dtype == "bfloat16":
        return _Bfloat16(copy.deepcopy(module).to(torch.bfloat16))
    return _quantize_linears(module, int8_layers)


class _Bfloat16(torch.nn.Module):
    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *inputs: torch.Tensor) -> tuple:
        cast = [t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs]
        return tuple(t.float() if t.is_floating_point() else t for t in _leaves(self.module(*cast)))


def _leaves(outputs) -> list:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    return [leaf for out in outputs for leaf in _leaves(out)]


class _Bfloat16Linear(torch.nn.Module):
    """A linear layer computed in bfloat16 between float32 neighbours."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight.detach().to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)


def constant_linears(module: fx.GraphModule) -> list[fx.Node]:
    """The `aten.linear(x, weight[, bias])` nodes whose weight (and bias) are constants of the
    graph, in graph order: the layers int8 can quantize."""
    found = []
    for node in module.graph.nodes:
        if node.op != "call_function" or node.target != torch.ops.aten.linear.default:
            continue
        weight, bias = (*node.args[1:], None)[:2]
        if weight.op == "get_attr" and (bias is None or bias.op == "get_attr"):
            found.append(node)
    return found


class _Int8Linear(torch.nn.Module):
    """A linear layer in int8: weights per output channel, the input quantized with the scale
    and zero point calibrated at partition time (not per batch: a request's scores never
    depend on what it was batched with), the output float32 (FBGEMM)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scale: float, zero: int):
        super().__init__()
        w = weight.detach().float()
        w_scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zeros = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated in PyTorch, still kept
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(w, w_scale, zeros, 0, torch.qint8)
        b = None if bias is None else bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack(qweight, b)
        self.scale, self.zero = float(scale), int(zero)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            x.float().contiguous(), self.scale, self.zero, self.packed
        )


def input_quantization(low: float, high: float) -> dict:
    """uint8 scale and zero point covering [low, high] (and 0)."""
    low, high = min(low, 0.0), max(high, 0.0)
    scale = max((high - low) / 255.0, 1e-8)
    return {"scale": scale, "zero_point": int(min(255, max(0, round(-low / scale))))}


def calibrate(module: fx.GraphModule, batches: list[list[torch.Tensor]]) -> list[dict]:
    """Per constant-weight linear layer (graph order), the input's uint8 quantization from
    the range its input takes on `batches` (the dense programs' inputs)."""
    layers = constant_linears(module)
    position = {node: i for i, node in enumerate(layers)}
    ranges = [[float("inf"), float("-inf")] for _ in layers]

    class Recorder(fx.Interpreter):
        def run_node(self, node):
            if node in position:
                x = self.env[node.args[0]]
                r = ranges[position[node]]
                r[0], r[1] = min(r[0], float(x.min())), max(r[1], float(x.max()))
            return super().run_node(node)

    with torch.inference_mode():
        for batch in batches:
            Recorder(module).run(*batch)
    return [
        input_quantization(lo, hi) if lo <= hi else input_quantization(0, 0) for lo, hi in ranges
    ]


def _quantize_linears(module: torch.nn.Module, layers: list[dict] | None) -> torch.nn.Module:
    """Replaces the constant-weight linear layers named in `layers` ({"layer": index, "scale",
    "zero_point"}) with int8 ones, and the other constant-weight linear layers with bfloat16
    ones."""
    if not isinstance(module, fx.GraphModule):
        raise UsageError(f"int8 needs the dense program as a graph, got {type(module).__name__}")
    q = copy.deepcopy(module)
    nodes = constant_linears(q)
    if not nodes:
        raise UsageError("int8: the dense program has no linear layer with constant weights")
    chosen = {spec["layer"]: spec for spec in layers or []}
    if not set(chosen) <= set(range(len(nodes))):
        raise UsageError(
            f"int8 layers {sorted(chosen)}: the dense program has {len(nodes)} linear layers"
        )
    for index, node in enumerate(nodes):
        x, weight, bias = (*node.args, None)[:3]
        w = getattr(q, weight.target)
        b = None if bias is None else getattr(q, bias.target)
        spec = chosen.get(index)
        if spec is not None:
            replacement = _Int8Linear(w, b, spec["scale"], spec["zero_point"])
        else:
            replacement = _Bfloat16Linear(w, b)
        name = f"linear_{index}_{'bf16' if spec is None else 'int8'}"
        q.add_submodule(name, replacement)
        with q.graph.inserting_before(node):
            node.replace_all_uses_with(q.graph.call_module(name, (x,)))
        q.graph.erase_node(node)
    q.graph.eliminate_dead_code()
    q.delete_all_unused_submodules()
    q.recompile()
    return q


def count_flops(module: torch.nn.Module, inputs: list[torch.Tensor]) -> int:
    """FLOPs of one run of `module` on `inputs` (2 per multiply-add of its matrix products),
    counted by PyTorch's FlopCounterMode as the program runs."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        module(*inputs)
    return int(counter.get_total_flops())
