"""What a serving benchmark sends: a model, its bundle, request bodies in each protocol and
the model's own outputs to check answers against; the dense program's roofline, which the
default latency budget scales with."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from cleave.bundle import manifest as manifest_io
from cleave.errors import UsageError
from cleave.partitioner.accuracy import REFERENCE_SAMPLES
from cleave.settings.choices import DENSE_DTYPES

PROTOCOLS = ("json", "binary", "grpc")


def parse_protocols(text: str) -> list[str]:
    """--protocol's comma-separated list, checked."""
    protocols = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in protocols if p not in PROTOCOLS]
    if not protocols or bad or len(set(protocols)) != len(protocols):
        raise UsageError(
            f"--protocol: expected distinct names of {', '.join(PROTOCOLS)} separated by "
            f"commas, got {text!r}"
        )
    return protocols


class Workload:
    """A model, its bundle, request bodies for the HTTP API and the model's own outputs.
    `roofline=False`: no dense program timed against the matmul peak (a command that times
    the program its own way)."""

    def __init__(self, args: argparse.Namespace, roofline: bool = True):
        import torch
        import torch.utils._pytree as pytree

        import cleave
        from cleave.bench.loadgen import build_body
        from cleave.models import MODELS, RequestGenerator

        if args.model not in MODELS:
            raise UsageError(f"--model must be one of {sorted(MODELS)}, got {args.model!r}")
        entry = MODELS[args.model]
        scale = entry.default_scale if args.scale is None else args.scale
        model, example = entry.factory(scale=scale, seed=args.seed)
        model.eval()
        # cleave bench serve without --dense-dtype: a bundle approving every dtype, served at
        # the rankers' choice ("auto"); other benchmarks: float32.
        dtype = getattr(args, "dense_dtype", "float32") or "auto"
        base = Path(args.workdir) / f"{args.model}-{scale:g}-{args.seed}"
        if args.bundle:
            self.bundle_dir = Path(args.bundle)
            bundle = cleave.load_bundle(self.bundle_dir, verify=False)
        else:
            self.bundle_dir = base if dtype == "float32" else base.with_name(f"{base.name}-{dtype}")
            labelled = (
                None
                if dtype == "float32"
                else RequestGenerator(args.model, scale=scale, seed=args.seed).labelled(
                    REFERENCE_SAMPLES, 256
                )
            )
            bundle = cleave.partition(
                model,
                example,
                dense_dtype="float32" if dtype == "auto" else dtype,
                dense_dtypes=list(DENSE_DTYPES) if dtype == "auto" else None,
                labelled=labelled,
            )
            bundle.save(self.bundle_dir, overwrite=True)
        # The dtypes the rankers may serve (the ranker's choice is read from its /metrics).
        self.served_dtypes = manifest_io.served_dtypes(bundle.manifest)
        # A reduced-precision bundle is also served in float32, the same way, for the ratio:
        # a bundle approving several is served again with its rankers told float32.
        self.float32_dir, self.float32_flags = None, []
        if len(self.served_dtypes) > 1:
            self.float32_dir, self.float32_flags = self.bundle_dir, ["--dense-dtype", "float32"]
        elif bundle.dense_dtype != "float32":
            self.float32_dir = base
            cleave.partition(model, example).save(base, overwrite=True)
        generator = RequestGenerator(args.model, scale=scale, alpha=args.alpha, seed=args.seed + 1)
        self.bundle = bundle
        # TorchRec's model as its author would save it, for the eager baseline's ranker.
        self.eager_model = None
        if entry.torchrec:
            self.eager_model = self.bundle_dir.with_name(f"{self.bundle_dir.name}-model.pt")
            torch.save(model, self.eager_model)
        self.inputs = [generator.batch(args.candidates) for _ in range(args.requests)]
        self.roofline = None
        # The latency budget (SLO): --budget-ms, else one the dense program's time gives.
        self.budget_ms = args.budget_ms
        # cleave bench serve: the dense program vs the CPU.
        if roofline and hasattr(args, "dense_dtype"):
            self.roofline = _rooflines(self, args)
            if self.budget_ms is None:
                self.budget_ms = default_budget_ms(self.roofline)
        # Overload and soak runs send a budget only when given one: else the router's default
        # is what they test.
        stress = getattr(args, "overload", False) or getattr(args, "soak", None)
        body_budget = args.budget_ms if stress else self.budget_ms
        self.sent_budget_ms = body_budget
        # The capacity of an overload run is measured with no budget (overload.py).
        self.unbudgeted: list = []
        protocols = getattr(args, "protocols", ["json"])
        self.bodies_for: dict[str, list] = {p: [] for p in protocols}
        # Per dtype served, each request's expected outputs and their distance to the model's.
        self.expected_for: dict[str, list] = {d: [] for d in self.served_dtypes}
        self.model_expected = []
        self.distance_for = dict.fromkeys(self.served_dtypes, 0.0)
        with torch.inference_mode():
            for inputs in self.inputs:
                named = bundle.named_inputs(*inputs)
                for protocol, bodies in self.bodies_for.items():
                    bodies.append(build_body(named, body_budget, protocol))
                if stress:
                    self.unbudgeted.append(build_body(named, None, protocols[0]))
                flat = [t.double().numpy() for t in pytree.tree_leaves(model(*inputs))]
                self.model_expected.append(flat)
                for dtype, expected in self.expected_for.items():
                    if dtype == "float32":
                        expected.append(flat)
                        continue
                    # A reduced-precision program is checked against the bundle's own
                    # reference executor; its distance to the float32 model is reported apart.
                    out = bundle.reference(*inputs, dtype=dtype)
                    own = [t.double().numpy() for t in pytree.tree_leaves(out)]
                    expected.append(own)
                    for o, f in zip(own, flat, strict=True):
                        if f.size:
                            far = max(self.distance_for[dtype], float(abs(o - f).max()))
                            self.distance_for[dtype] = far
        self.expected = self.expected_for[self.served_dtypes[-1]]
        self.float32_distance = self.distance_for[self.served_dtypes[-1]]
        # The first protocol's bodies: what a single-protocol command sends.
        self.bodies = self.bodies_for[protocols[0]]
        self.name = self.bundle_dir.name
        self.scale = scale

    def check(
        self, index: int, response: dict, want_model: bool = False, dtype: str | None = None
    ) -> float:
        """Largest distance of a response's outputs from the expected ones: the bundle's own
        reference executor's at `dtype`, the one served (the model's for float32; default:
        the bundle's least precise), or with `want_model` the float32 model's."""
        from cleave.bench.loadgen import outputs_of

        got = outputs_of(response)
        expected = self.expected_for.get(dtype, self.expected)
        want = (self.model_expected if want_model else expected)[index]
        if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want, strict=True)):
            return float("inf")
        return max(
            float(abs(g - w).max()) if g.size else 0.0 for g, w in zip(got, want, strict=True)
        )


def default_budget_ms(roofline: dict) -> float:
    """25 ms, or twice the float32 dense program's time per request on one thread when that is
    more (rounded up to 5 ms)."""
    return max(25.0, 5.0 * math.ceil(2 * roofline["float32_one_thread_ms"] / 5.0))


def _rooflines(workload: Workload, args) -> dict:
    """The served dense program (and the float32 one) against the matmul peak, at the threads
    a ranker gets; and the float32 program on one thread, which the default budget scales by.
    For a bundle whose rankers choose among dtypes, each one's (`by_dtype`, uncompiled)."""
    import cleave
    from cleave.bench.roofline import roofline
    from cleave.settings import ServeConfig

    bundle = workload.bundle
    config = ServeConfig(rankers=args.rankers)
    threads = args.threads or config.ranker_threads(bundle.manifest["dense"].get("demand"))
    dense_args = bundle.dense_inputs(*workload.inputs[0])
    program = None
    if args.compile:
        from cleave.ranker.program import compile_program

        program = compile_program(bundle.dense_module(), Path(args.workdir) / "inductor")
    served = roofline(bundle, dense_args, threads, program)
    fp32 = bundle
    if workload.float32_dir not in (None, workload.bundle_dir):
        fp32 = cleave.load_bundle(workload.float32_dir, verify=False)
    result = {"served": served, "float32": served}
    if fp32 is not bundle:
        result["float32"] = roofline(fp32, dense_args, threads)
    result["float32_one_thread_ms"] = roofline(fp32, dense_args, 1)["dense_ms"]
    if len(workload.served_dtypes) > 1:  # the rankers choose: "served" is set once known
        result["by_dtype"] = {
            d: served if d == bundle.dense_dtype else roofline(bundle, dense_args, threads, dtype=d)
            for d in workload.served_dtypes
        }
    return result


def print_roofline(roof: dict) -> None:
    print("dense program vs the matrix-multiply peak (same dtype and threads, this run):")
    for name in dict.fromkeys(("served", "float32")):
        r = roof[name]
        peak = f"{r['peak_gflops']:.0f}" if r["peak_gflops"] else "-"
        share = f"{100 * r['fraction_of_peak']:.0f}%" if r["fraction_of_peak"] else "-"
        print(
            f"  {r['dtype']:<9} {r['threads']} threads{' compiled' if r['compiled'] else ''}: "
            f"{r['dense_ms']:.2f} ms per request of {r['rows']}, {r['achieved_gflops']:.0f} "
            f"GFLOP/s of a {peak} GFLOP/s peak ({share})"
        )
        if roof["served"] is roof["float32"]:
            break


def read_bundle_summary(bundle_dir: Path) -> dict:
    manifest = manifest_io.read(Path(bundle_dir))
    return {
        "tables": len(manifest["tables"]),
        "table_mib": sum(t["rows"] * t["row_bytes"] for t in manifest["tables"]) / 2**20,
        "dense_inputs": len(manifest["dense"]["inputs"]),
        "dense_dtype": manifest["dense"].get("dtype", "float32"),
        "dense_dtypes": manifest["dense"].get("dtypes"),
        "accuracy": manifest["dense"].get("accuracy"),
    }
