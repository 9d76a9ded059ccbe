"""What a reduced-precision dense program costs in accuracy, measured before a bundle is
written: AUC and score distance against the float32 program on a labelled set. A conversion
past the limits is refused (AccuracyError); one within them is recorded in the manifest."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from cleave.bundle import Bundle
from cleave.bundle.precision import calibrate, constant_linears, convert
from cleave.errors import CleaveError, UsageError

# Labelled samples drawn for a reference model when the user gives no labelled set.
REFERENCE_SAMPLES = 4096


class AccuracyError(CleaveError):
    """A reduced-precision dense program moved AUC or scores past the limits."""


@dataclass
class AccuracyLimits:
    max_auc_drop: float = 0.001  # |AUC(dtype) - AUC(float32)| allowed on the labelled set
    score_tolerance: float = 0.02  # largest |score(dtype) - score(float32)| allowed

    def check(self) -> AccuracyLimits:
        for key in ("max_auc_drop", "score_tolerance"):
            value = getattr(self, key)
            if not (isinstance(value, int | float) and value >= 0):
                raise UsageError(f"{key} must be a number >= 0, got {value!r}")
        return self


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U with tied scores sharing their mean rank)."""
    positives = int((labels == 1).sum())
    negatives = len(labels) - positives
    if positives == 0 or negatives == 0:
        raise UsageError(
            f"the labelled set needs both classes to measure AUC, got {positives} positive "
            f"and {negatives} negative labels"
        )
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    mean_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based mean rank of each tie group
    ranks = mean_rank[inverse]
    return float(
        (ranks[labels == 1].sum() - positives * (positives + 1) / 2) / (positives * negatives)
    )


class LabelledSet:
    """A labelled set [(forward args, labels)] run through the sparse side once: the dense
    programs' inputs per batch, the labels, and the float32 program's outputs."""

    def __init__(self, bundle: Bundle, labelled):
        self.fp32 = bundle.dense_module("float32")
        self.batches, labels = [], []
        with torch.inference_mode():
            for i, item in enumerate(labelled):
                if not (isinstance(item, tuple | list) and len(item) == 2):
                    raise UsageError(f"labelled set item {i}: expected (forward args, labels)")
                args, batch_labels = item
                dense_args = bundle.dense_inputs(*args)
                want = self.fp32(*dense_args)
                batch_labels = torch.as_tensor(batch_labels).reshape(-1).double()
                if batch_labels.numel() != want[0].numel():
                    raise UsageError(
                        f"labelled set item {i}: {batch_labels.numel()} labels, but the model's "
                        f"first output has {want[0].numel()} values"
                    )
                self.batches.append((dense_args, want))
                labels.append(batch_labels)
        if not labels:
            raise UsageError("the labelled set is empty")
        self.labels = torch.cat(labels).numpy()
        self.auc_float32 = auc(self._first(w for _, w in self.batches), self.labels)

    @staticmethod
    def _first(outputs) -> np.ndarray:
        return torch.cat([o[0].reshape(-1).double() for o in outputs]).numpy()

    def evaluate(self, module) -> tuple[float, float]:
        """(AUC, largest change of any output value against float32) of `module`."""
        got, worst = [], 0.0
        with torch.inference_mode():
            for dense_args, want in self.batches:
                out = module(*dense_args)
                for w, g in zip(want, out, strict=True):
                    if w.numel():
                        worst = max(worst, float((w.double() - g.double()).abs().max()))
                got.append(out)
        return auc(self._first(got), self.labels), worst

    def within(self, module, limits: AccuracyLimits) -> bool:
        value, worst = self.evaluate(module)
        return abs(value - self.auc_float32) <= limits.max_auc_drop and (
            worst <= limits.score_tolerance
        )


def choose_int8_layers(data: LabelledSet, limits: AccuracyLimits) -> list[dict]:
    """The linear layers to run in int8, with their inputs' quantization calibrated on the
    labelled set: each layer's harm when quantized alone is measured, then layers are added
    from the least to the most harmful (ties: the largest first) while the whole stays within
    `limits`; the rest run in bfloat16. Greedy, like mixed-precision searches."""
    specs = [
        {"layer": i, **q}
        for i, q in enumerate(calibrate(data.fp32, [args for args, _ in data.batches]))
    ]
    nodes = constant_linears(data.fp32)
    harm = []
    for spec, node in zip(specs, nodes, strict=True):
        value, worst = data.evaluate(convert(data.fp32, "int8", [spec]))
        size = getattr(data.fp32, node.args[1].target).numel()
        harm.append((abs(value - data.auc_float32), worst, -size, spec["layer"]))
    chosen: list[dict] = []
    for *_, index in sorted(harm):
        if data.within(convert(data.fp32, "int8", [*chosen, specs[index]]), limits):
            chosen.append(specs[index])
    return sorted(chosen, key=lambda spec: spec["layer"])


def measure(bundle: Bundle, dtype: str, labelled, limits: AccuracyLimits) -> dict:
    """Runs the labelled set [(forward args, labels)], or a LabelledSet, through the float32
    and the `dtype` dense programs (the sparse side by the reference executor) and returns the
    measurement; for int8 it first chooses the layers to quantize (`int8_layers` in the
    result). Raises AccuracyError when the program is past `limits` (for int8: when no layer
    can be)."""
    data = labelled if isinstance(labelled, LabelledSet) else LabelledSet(bundle, labelled)
    layers = None
    if dtype == "int8":
        layers = choose_int8_layers(data, limits)
    auc_dtype, worst = data.evaluate(convert(data.fp32, dtype, layers))
    auc_fp32 = data.auc_float32
    result = {
        "samples": len(data.labels),
        "auc_float32": round(auc_fp32, 6),
        "auc": round(auc_dtype, 6),
        "auc_delta": round(auc_dtype - auc_fp32, 6),
        "max_score_diff": worst,
        "max_auc_drop": limits.max_auc_drop,
        "score_tolerance": limits.score_tolerance,
    }
    problems = []
    if layers is not None and not layers:
        problems.append("no linear layer can be quantized without passing the limits")
    if abs(auc_dtype - auc_fp32) > limits.max_auc_drop:
        problems.append(
            f"AUC moved by {auc_dtype - auc_fp32:+.5f} ({auc_fp32:.5f} -> {auc_dtype:.5f}), "
            f"more than the {limits.max_auc_drop:g} allowed"
        )
    if worst > limits.score_tolerance:
        problems.append(
            f"scores moved by up to {worst:.4g}, more than the tolerance {limits.score_tolerance:g}"
        )
    if problems:
        raise AccuracyError(
            f"dense dtype {dtype} refused on {len(data.labels)} labelled samples: "
            + "; ".join(problems)
            + " (keep float32, try another dtype, or relax --max-auc-drop / --score-tolerance)"
        )
    if layers is not None:
        result["int8_layers"] = layers
    return result


def demand(bundle: Bundle, dtype: str, args: tuple, repeats: int = 3) -> dict:
    """Seconds per sample of the sparse side (reference executor) and of the dense program on
    one thread, on `args`: what `cleave serve` splits cores by (docs/serving.md)."""
    module = bundle.dense_module(dtype)
    names = bundle.manifest["dense"]["inputs"]
    inputs = bundle.named_inputs(*args)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            sparse_s, dense_s = float("inf"), float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                values = {**inputs, **bundle.sparse_reference(inputs)}
                t1 = time.perf_counter()
                module(*[values[n] for n in names])
                t2 = time.perf_counter()
                sparse_s, dense_s = min(sparse_s, t1 - t0), min(dense_s, t2 - t1)
    finally:
        torch.set_num_threads(threads)
    rows = max(1, batch_rows(bundle, inputs))
    return {
        "sparse_us_per_sample": round(sparse_s / rows * 1e6, 3),
        "dense_us_per_sample": round(dense_s / rows * 1e6, 3),
        "batch": rows,
    }


def batch_rows(bundle: Bundle, inputs: dict) -> int:
    """Rows of the batch dimension B in a request's named inputs (1 when none has it)."""
    for spec in bundle.manifest["inputs"]:
        shape = spec["shape"]
        if shape and shape[0] == "B":
            return int(inputs[spec["name"]].shape[0])
    return 1
