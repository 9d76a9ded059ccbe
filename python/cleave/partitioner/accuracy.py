"""What a reduced-precision dense program costs in accuracy, measured before a bundle is
written: AUC and score distance against the float32 program on a labelled set. A conversion
past the limits is refused (AccuracyError); one within them is recorded in the manifest."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from cleave.bundle import Bundle
from cleave.bundle.precision import convert
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


def measure(bundle: Bundle, dtype: str, labelled, limits: AccuracyLimits) -> dict:
    """Runs the labelled set [(forward args, labels)] through the float32 and the `dtype`
    dense programs (the sparse side by the reference executor) and returns the measurement;
    raises AccuracyError when it is past `limits`."""
    fp32 = bundle.dense_module("float32")
    reduced = convert(fp32, dtype)
    names = bundle.manifest["dense"]["inputs"]
    ref_scores, scores, labels, worst = [], [], [], 0.0
    with torch.inference_mode():
        for i, item in enumerate(labelled):
            if not (isinstance(item, tuple | list) and len(item) == 2):
                raise UsageError(f"labelled set item {i}: expected (forward args, labels)")
            args, batch_labels = item
            inputs = bundle.named_inputs(*args)
            values = {**inputs, **bundle.sparse_reference(inputs)}
            dense_args = [values[n] for n in names]
            want, got = fp32(*dense_args), reduced(*dense_args)
            for w, g in zip(want, got, strict=True):
                if w.numel():
                    worst = max(worst, float((w.double() - g.double()).abs().max()))
            first = want[0].reshape(-1)
            batch_labels = torch.as_tensor(batch_labels).reshape(-1)
            if batch_labels.numel() != first.numel():
                raise UsageError(
                    f"labelled set item {i}: {batch_labels.numel()} labels, but the model's "
                    f"first output has {first.numel()} values"
                )
            ref_scores.append(first.double())
            scores.append(got[0].reshape(-1).double())
            labels.append(batch_labels.double())
    if not labels:
        raise UsageError("the labelled set is empty")
    y = torch.cat(labels).numpy()
    auc_fp32 = auc(torch.cat(ref_scores).numpy(), y)
    auc_dtype = auc(torch.cat(scores).numpy(), y)
    result = {
        "samples": len(y),
        "auc_float32": round(auc_fp32, 6),
        "auc": round(auc_dtype, 6),
        "auc_delta": round(auc_dtype - auc_fp32, 6),
        "max_score_diff": worst,
        "max_auc_drop": limits.max_auc_drop,
        "score_tolerance": limits.score_tolerance,
    }
    problems = []
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
            f"dense dtype {dtype} refused on {len(y)} labelled samples: "
            + "; ".join(problems)
            + " (keep float32, try another dtype, or relax --max-auc-drop / --score-tolerance)"
        )
    return result


def demand(bundle: Bundle, dtype: str, args: tuple, repeats: int = 3) -> dict:
    """Seconds per sample of the sparse side (reference executor) and of the dense program on
    one thread, on `args`: what `cleave serve` splits cores by (docs/serving.md)."""
    module = convert(bundle.dense_module("float32"), dtype)
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
    rows = max(1, _batch_rows(bundle, inputs))
    return {
        "sparse_us_per_sample": round(sparse_s / rows * 1e6, 3),
        "dense_us_per_sample": round(dense_s / rows * 1e6, 3),
        "batch": rows,
    }


def _batch_rows(bundle: Bundle, inputs: dict) -> int:
    for spec in bundle.manifest["inputs"]:
        shape = spec["shape"]
        if shape and shape[0] == "B":
            return int(inputs[spec["name"]].shape[0])
    return 1
