"""Dense precision as a bundle property (`--dense-dtype`): the accuracy check that refuses a
conversion, what the bundle records, the ranker's probe check and compiled programs, the
split of cores by measured demand, and the benchmark's roofline and dtype comparison."""

from __future__ import annotations

import cleave
import numpy as np
import pytest
import torch
from cleave.bench.roofline import roofline
from cleave.bundle import precision
from cleave.bundle.precision import constant_linears, convert, count_flops, slow_reason
from cleave.errors import CleaveError, UsageError
from cleave.models import MODELS, RequestGenerator
from cleave.partitioner import AccuracyError, AccuracyLimits
from cleave.partitioner.accuracy import auc
from cleave.ranker.dense_dtype import MARGIN
from cleave.ranker.local import LocalQueue
from cleave.ranker.payload import KIND_RANK, KIND_RANK_FULL, decode_response, encode_request
from cleave.ranker.probes import Probes
from cleave.ranker.program import load_ranker
from cleave.settings import ranker_cores
from support.cli import refused
from support.processes import get

SCALE = 0.01
LOOSE = AccuracyLimits(max_auc_drop=1.0, score_tolerance=1.0)


@pytest.fixture(scope="module")
def model():
    return MODELS["shared"].factory(scale=SCALE)


@pytest.fixture(scope="module")
def labelled():
    return RequestGenerator("shared", scale=SCALE).labelled(2048, 256)


@pytest.fixture(scope="module")
def bf16_dir(model, labelled, tmp_path_factory):
    net, example = model
    bundle = cleave.partition(net, example, dense_dtype="bfloat16", labelled=labelled)
    return bundle.save(tmp_path_factory.mktemp("bf16") / "bundle")


def dense_args(bundle, args) -> list[torch.Tensor]:
    inputs = bundle.named_inputs(*args)
    values = {**inputs, **bundle.sparse_reference(inputs)}
    return [values[n] for n in bundle.manifest["dense"]["inputs"]]


def test_auc_matches_pairwise_counting_with_ties():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, 300).astype(float)  # many ties
    labels = (rng.random(300) < 0.4).astype(float)
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert auc(scores, labels) == pytest.approx(pairs / (len(pos) * len(neg)))
    with pytest.raises(UsageError, match="both classes"):
        auc(scores, np.ones(300))


def test_bfloat16_bundle_records_its_accuracy_and_serves_it(bf16_dir, model):
    bundle = cleave.load_bundle(bf16_dir)
    dense = bundle.manifest["dense"]
    assert dense["dtype"] == "bfloat16" and dense["probe"] == "dense_probe.pt"
    accuracy = dense["accuracy"]
    assert accuracy["samples"] == 2048 and abs(accuracy["auc_delta"]) <= 0.001
    assert 0 < accuracy["max_score_diff"] <= accuracy["score_tolerance"] == 0.02
    assert accuracy["auc_float32"] > 0.7  # the teacher's labels carry signal
    assert dense["flops_per_sample"] > 0 and dense["demand"]["dense_us_per_sample"] > 0
    # The served program runs in bfloat16 and stays near the float32 model.
    net, _ = model
    args = RequestGenerator("shared", scale=SCALE, seed=5).batch(7)
    with torch.no_grad():
        want = net(*args)
    got = bundle.reference(*args)
    assert got.dtype == torch.float32
    assert 0 < float((got - want).abs().max()) <= 0.02
    served = bundle.dense_module()
    assert any(p.dtype == torch.bfloat16 for p in served.parameters())


def test_int8_quantizes_only_the_layers_the_limits_allow_and_refuses_when_none_can(
    model, labelled, tmp_path
):
    net, example = model
    strict = AccuracyLimits(max_auc_drop=0.0, score_tolerance=1e-6)
    with pytest.raises(AccuracyError, match=r"dense dtype int8 refused on 2048 labelled samples"):
        cleave.partition(net, example, dense_dtype="int8", labelled=labelled, limits=strict)
    bundle = cleave.partition(net, example, dense_dtype="int8", labelled=labelled, limits=LOOSE)
    dense = bundle.manifest["dense"]
    layers = constant_linears(bundle.dense_module("float32"))
    assert dense["dtype"] == "int8"
    assert [spec["layer"] for spec in dense["int8_layers"]] == list(range(len(layers)))
    default = cleave.partition(net, example, dense_dtype="int8", labelled=labelled)
    chosen = default.manifest["dense"]["int8_layers"]
    assert abs(default.manifest["dense"]["accuracy"]["auc_delta"]) <= 0.001
    children = default.dense_module().named_children()
    kinds = [name.rsplit("_", 1)[1] for name, _ in children if name.startswith("linear_")]
    assert len(kinds) == len(layers) and kinds.count("int8") == len(chosen) > 0
    # The choice travels with the bundle: a loaded bundle serves the same program.
    args = RequestGenerator("shared", scale=SCALE, seed=8).batch(5)
    # Inputs are quantized with calibrated scales, not per batch: a request's scores do not
    # depend on the requests it is batched with.
    batch = dense_args(default, RequestGenerator("shared", scale=SCALE, seed=9).batch(12))
    alone = [t[:3] if t.shape[0] == 12 else t for t in batch]
    with torch.inference_mode():
        together, by_itself = default.dense_module()(*batch)[0], default.dense_module()(*alone)[0]
    assert torch.allclose(together[:3], by_itself, atol=1e-6)
    loaded = cleave.load_bundle(default.save(tmp_path / "int8"))
    assert loaded.manifest["dense"]["int8_layers"] == chosen
    assert torch.equal(loaded.reference(*args), default.reference(*args))


def test_reduced_dtype_without_labels_or_with_bad_labels_is_a_clear_error(model, labelled):
    net, example = model
    with pytest.raises(UsageError, match="needs a labelled set"):
        cleave.partition(net, example, dense_dtype="bfloat16")
    with pytest.raises(UsageError, match='dense dtype must be "float32", "bfloat16" or "int8"'):
        cleave.partition(net, example, dense_dtype="float8")
    (args, labels) = labelled[0]
    with pytest.raises(UsageError, match="labels, but the model's first output has"):
        cleave.partition(net, example, dense_dtype="bfloat16", labelled=[(args, labels[:3])])
    with pytest.raises(UsageError, match="max_auc_drop must be a number >= 0"):
        cleave.partition(
            net, example, dense_dtype="bfloat16", labelled=labelled, limits=AccuracyLimits(-1)
        )


def test_int8_of_a_program_without_linear_layers_is_refused():
    graph = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(UsageError, match="no linear layer"):
        convert(graph, "int8")


def test_flops_and_cpu_support(monkeypatch):
    linear = torch.nn.Linear(64, 32)
    assert count_flops(linear, [torch.randn(10, 64)]) == 2 * 10 * 64 * 32
    assert slow_reason("float32") is None and slow_reason("bfloat16", "cuda") is None
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "avx512_vnni"}))
    assert slow_reason("int8") and "bfloat16 layers are emulated" in slow_reason("int8")
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx512_bf16", "avx_vnni"}))
    assert slow_reason("int8") is None and slow_reason("bfloat16") is None


def rank(batcher, queue, tensors, kind=KIND_RANK):
    future = queue.submit(kind, encode_request(tensors))
    for _ in range(100):  # bounded: one step serves it
        if future.done():
            break
        batcher.step()
    return decode_response(future.result(timeout=10)).tensors


def test_ranker_serves_the_bundles_dtype_and_refuses_a_program_off_its_probe(bf16_dir, tmp_path):
    bundle = cleave.load_bundle(bf16_dir)
    args = RequestGenerator("shared", scale=SCALE, seed=3).batch(5)
    tensors = dense_args(bundle, args)
    queue = LocalQueue()
    batcher = load_ranker(bf16_dir, queue, threads=1)
    (got,) = rank(batcher, queue, tensors)
    assert torch.equal(got, bundle.reference(*args).reshape(got.shape))
    # A probe whose float32 outputs the program no longer matches: the ranker will not serve.
    probe = torch.load(bf16_dir / "dense_probe.pt", weights_only=True)
    probe["outputs"] = [t + 0.5 for t in probe["outputs"]]
    torch.save(probe, bf16_dir / "dense_probe.pt")
    try:
        with pytest.raises(CleaveError, match="not served"):
            load_ranker(bf16_dir, LocalQueue(), threads=1)
    finally:
        probe["outputs"] = [t - 0.5 for t in probe["outputs"]]
        torch.save(probe, bf16_dir / "dense_probe.pt")


def test_monolithic_ranker_runs_the_whole_model_at_the_bundles_dtype(bf16_dir):
    bundle = cleave.load_bundle(bf16_dir)
    args = RequestGenerator("shared", scale=SCALE, seed=6).batch(4)
    queue = LocalQueue()
    batcher = load_ranker(bf16_dir, queue, monolithic=True, threads=1)
    inputs = list(bundle.named_inputs(*args).values())
    (got,) = rank(batcher, queue, inputs, kind=KIND_RANK_FULL)
    assert torch.equal(got, bundle.reference(*args).reshape(got.shape))


def test_compiled_ranker_matches_eager_and_keeps_its_cache(bf16_dir, tmp_path):
    cache = tmp_path / "inductor"
    bundle = cleave.load_bundle(bf16_dir)
    args = RequestGenerator("shared", scale=SCALE, seed=4).batch(9)
    queue = LocalQueue()
    batcher = load_ranker(bf16_dir, queue, threads=1, compile=True, compile_cache=str(cache))
    (got,) = rank(batcher, queue, dense_args(bundle, args))
    want = bundle.reference(*args).reshape(got.shape)
    assert float((got - want).abs().max()) <= 0.02
    assert any(cache.rglob("*"))  # generated code kept for the next start
    # Compiled and eager were both timed at start; the faster one serves (either answers).
    choice, seconds = batcher.dense_choice, batcher.dense_choice.compile_seconds
    assert set(seconds) == {"eager", "compiled"}
    assert choice.compiled == (seconds["compiled"] <= seconds["eager"] * (1 + MARGIN))
    probes = Probes(batcher)
    try:
        status, text = get(f"{probes.address}/metrics")
    finally:
        probes.close()
    assert f"cleave_ranker_dense_compiled {float(choice.compiled)}" in text
    assert 'cleave_ranker_dense_compile_probe_seconds{program="compiled"}' in text


def test_the_roofline_times_a_compiled_program(bf16_dir):
    # `bench serve --compile` hands the roofline torch.compile's module, whose truth value
    # raises (it forwards len() to the module it wraps): the bench crashed before measuring.
    bundle = cleave.load_bundle(bf16_dir)
    args = RequestGenerator("shared", scale=SCALE, seed=4).batch(9)
    program = torch.compile(bundle.dense_module(), backend="eager")
    result = roofline(bundle, dense_args(bundle, args), 1, program)
    assert result["compiled"] and result["dense_ms"] > 0


def test_the_monolith_runs_a_compiled_program(bf16_dir):
    # `cleave serve --monolithic --compile` wraps the compiled program in the whole model: its
    # truth value raised there too, and the monolith exited before it was ready.
    bundle = cleave.load_bundle(bf16_dir)
    args = RequestGenerator("shared", scale=SCALE, seed=4).batch(9)
    full = bundle.full_module(torch.compile(bundle.dense_module(), backend="eager"))
    with torch.inference_mode():
        (got,) = full(*bundle.named_inputs(*args).values())
    want = bundle.reference(*args).reshape(got.shape)
    assert float((got - want).abs().max()) <= 1e-6


def test_cores_follow_measured_demand():
    dense_heavy = {"dense_us_per_sample": 900.0, "sparse_us_per_sample": 50.0}
    balanced = {"dense_us_per_sample": 100.0, "sparse_us_per_sample": 100.0}
    assert ranker_cores(16, 1, False, dense_heavy) == 14
    assert ranker_cores(16, 1, False, balanced) == 8
    assert ranker_cores(16, 2, False, dense_heavy) == 7
    assert ranker_cores(16, 1, True, balanced) == 15  # the monolith: every core but one
    assert ranker_cores(2, 1, False, dense_heavy) == 1
    assert ranker_cores(16, 1, False, None) == 15  # an older bundle: the old rule
    assert ranker_cores(1, 4, False, balanced) == 1


def test_partition_cli_refuses_a_failing_dtype_and_writes_nothing(tmp_path):
    out = tmp_path / "bundle"

    def partition(*flags: str) -> str:  # in this process: tests/factories.py is importable
        return refused("partition", "-o", str(out), *flags)

    message = partition("--model", "factories:shape_control_flow", "--dense-dtype", "bfloat16")
    assert "needs a labelled set" in message
    message = partition(
        "--model", "factories:shape_control_flow", "--dense-dtype", "int8",
        "--labelled", "factories:no_such_function",
    )  # fmt: skip
    assert "has no callable 'no_such_function'" in message
    # A reference model whose int8 program moves AUC too far (its own labelled set).
    message = partition(
        "--model", "cleave.models:shared_weighted", "--dense-dtype", "int8",
        "--max-auc-drop", "0", "--score-tolerance", "0",
    )  # fmt: skip
    assert "dense dtype int8 refused" in message
    assert not out.exists()
