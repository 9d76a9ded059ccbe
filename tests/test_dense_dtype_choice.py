"""Precision chosen where it runs (`--dense-dtypes`): the partitioner approves or refuses each
listed dtype, a ranker probes the approved ones and serves the fastest (an explicit one wins),
and every ranker of a deployment serves the first one's choice."""

from __future__ import annotations

import re
from pathlib import Path

import cleave
import pytest
import torch
from cleave.bench.stages import metrics_endpoints, printed_all_metrics
from cleave.bundle.manifest import served_dtypes
from cleave.errors import UsageError
from cleave.launch.process import ServeProcess
from cleave.models import MODELS, RequestGenerator
from cleave.partitioner import AccuracyLimits
from cleave.ranker import dense_dtype
from cleave.ranker.dense_dtype import DenseChoice, choose, settle
from cleave.ranker.local import LocalQueue
from cleave.ranker.probes import Probes
from cleave.ranker.program import load_ranker
from support.cli import refused
from support.client import post
from support.processes import get
from support.waiting import wait_for

SCALE = 0.01
ALL = ["float32", "bfloat16", "int8"]


@pytest.fixture(scope="module")
def roles(tmp_path_factory) -> dict:
    """A bundle of the shared-input model approving float32 and int8, refusing bfloat16: its
    score tolerance lies just under how far bfloat16 moves the scores on this CPU (measured
    first: rounding differs between CPUs), which int8 meets by keeping fewer layers in int8.
    {"dir", "approved", "refused", "limits"}."""
    net, example = MODELS["shared"].factory(scale=SCALE)
    labelled = RequestGenerator("shared", scale=SCALE).labelled(1024, 256)
    loose = AccuracyLimits(max_auc_drop=1.0, score_tolerance=1.0)
    bf16 = cleave.partition(
        net, example, dense_dtypes=["bfloat16"], labelled=labelled, limits=loose
    )
    moved = bf16.manifest["dense"]["dtypes"]["bfloat16"]["accuracy"]["max_score_diff"]
    limits = AccuracyLimits(max_auc_drop=1.0, score_tolerance=0.99 * moved)
    bundle = cleave.partition(net, example, dense_dtypes=ALL, labelled=labelled, limits=limits)
    path = bundle.save(tmp_path_factory.mktemp("several") / "shared")
    return {"dir": path, "approved": "int8", "refused": "bfloat16", "limits": limits}


@pytest.fixture(scope="module")
def several(roles) -> Path:
    return roles["dir"]


# -- the chooser ----------------------------------------------------------------------------


def test_the_fastest_dtype_is_chosen_unless_a_more_precise_one_is_as_fast():
    # The machine: int8 fastest, bfloat16 slower than float32 (no AMX).
    assert choose({"float32": 0.039, "bfloat16": 0.052, "int8": 0.027}) == "int8"
    # A machine where bfloat16 is fast and int8 is not.
    assert choose({"float32": 0.040, "bfloat16": 0.010, "int8": 0.030}) == "bfloat16"
    # Within the margin the more precise program is served: the probe's noise does not decide.
    assert choose({"float32": 0.0400, "bfloat16": 0.0390}) == "float32"
    assert choose({"bfloat16": 0.0200, "int8": 0.0195}) == "bfloat16"
    assert choose({"int8": 0.01}) == "int8"
    with pytest.raises(ValueError, match="no dense dtype was measured"):
        choose({})


def test_settle_probes_only_with_several_candidates_and_an_explicit_dtype_wins(monkeypatch):
    manifest = {"dense": {"dtype": "float32", "dtypes": {d: {"approved": True} for d in ALL}}}
    timed = {"float32": 0.040, "bfloat16": 0.060, "int8": 0.013}  # injected costs per batch
    runs = []

    def run(module, inputs):
        runs.append(module)

    monkeypatch.setattr(dense_dtype, "probe", lambda modules, inputs, run: timed)

    def batch():
        return [torch.zeros(4)], 4

    choice = settle(manifest, "auto", "cpu", lambda d: d, batch, run)
    assert choice == DenseChoice("int8", "probe", timed, 4)
    assert dense_dtype.describe(choice).startswith("dense dtype int8 (chosen by probe: ")
    # On a GPU int8 (FBGEMM, CPU only) is no candidate.
    timed.pop("int8")
    assert settle(manifest, "auto", "cuda", str, batch, run).dtype == "float32"
    # An explicit dtype is served without a probe; one the bundle does not approve is refused.
    assert settle(manifest, "bfloat16", "cpu", str, None, run) == DenseChoice("bfloat16", "flag")
    assert settle(manifest, "auto", "cpu", str, lambda: None, run).chosen_by == "bundle"
    manifest["dense"]["dtypes"]["int8"] = {"approved": False, "refused": "AUC moved"}
    with pytest.raises(UsageError, match="--dense-dtype int8: the bundle approves float32, bf"):
        settle(manifest, "int8", "cpu", str, None, run)
    # A bundle of one dtype (partitioned with --dense-dtype) serves it.
    one = {"dense": {"dtype": "bfloat16"}}
    assert settle(one, "auto", "cpu", str, None, run) == DenseChoice("bfloat16", "bundle")
    assert runs == []


def test_the_probe_times_every_module_within_its_budget():
    calls = {"a": 0, "b": 0}

    def run(module, inputs):
        calls[module] += 1

    seconds = dense_dtype.probe({"float32": "a", "int8": "b"}, [], run)
    assert set(seconds) == {"float32", "int8"} and all(s >= 0 for s in seconds.values())
    assert 2 <= calls["a"] <= 1 + dense_dtype.PROBE_RUNS  # a warm-up, then timed runs
    assert 2 <= calls["b"] <= 1 + dense_dtype.PROBE_RUNS


def test_the_compiled_program_is_served_only_where_it_is_no_slower(monkeypatch, caplog):
    runs = []

    def run(module, inputs):
        runs.append(module)

    def batch():
        return [torch.zeros(4)], 4

    timed = {"eager": 0.0361, "compiled": 0.0409}  # injected: dcn's int8 program on the AMD
    monkeypatch.setattr(dense_dtype, "probe", lambda modules, inputs, run: dict(timed))
    choice = DenseChoice("int8", "probe")
    assert not dense_dtype.keep_compiled(choice, "eager", "compiled", batch, run)
    assert runs == ["compiled"]  # compiled at the probe's size before it is timed
    assert (choice.compiled, choice.compile_seconds) == (False, timed)
    assert "served uncompiled: compiled is slower here (eager 36.10 ms, compiled 40.90" in (
        caplog.text
    )
    # Within the margin, or faster, the compiled program is served, as asked.
    for compiled in (0.0375, 0.030):
        timed["compiled"] = compiled
        assert dense_dtype.keep_compiled(DenseChoice("int8", "probe"), "e", "c", batch, run)
    # No batch to time (a symbolic size): compiled, as asked.
    choice = DenseChoice("float32", "bundle")
    assert dense_dtype.keep_compiled(choice, "e", "c", lambda: None, run)
    assert (choice.compiled, choice.compile_seconds) == (True, {})


# -- the partitioner ------------------------------------------------------------------------


def test_partition_records_each_listed_dtype_approved_or_refused(roles):
    bundle = cleave.load_bundle(roles["dir"])
    approved, refused = roles["approved"], roles["refused"]
    dense = bundle.manifest["dense"]
    assert dense["dtype"] == "float32" and served_dtypes(bundle.manifest) == ["float32", approved]
    table = dense["dtypes"]
    assert list(table) == ALL
    assert table["float32"]["approved"] and table["float32"]["dense_us_per_sample"] > 0
    assert table[refused]["approved"] is False
    assert "scores moved by up to" in table[refused]["refused"]
    chosen = table[approved]
    assert chosen["approved"] and chosen["dense_us_per_sample"] > 0
    assert chosen["accuracy"]["max_score_diff"] <= roles["limits"].score_tolerance
    assert dense["int8_layers"]  # the approved int8 program's layers, where convert reads them
    assert dense["demand"]["dense_us_per_sample"] == table["float32"]["dense_us_per_sample"]


def test_partition_cli_refuses_bad_dtype_lists_before_loading_the_model(tmp_path):
    out = str(tmp_path / "bundle")

    def partition(*flags: str) -> str:
        return refused("partition", "--model", "factories:no_such_factory", "-o", out, *flags)

    assert 'each must be "float32", "bfloat16" or "int8", got \'fp7\'' in partition(
        "--dense-dtypes", "float32,fp7"
    )
    assert "expected a comma-separated list" in partition("--dense-dtypes", "")
    assert "expected a comma-separated list" in partition("--dense-dtypes", "float32,,int8")
    assert "each may be listed once, got int8 twice" in partition(
        "--dense-dtypes", "int8,float32,int8"
    )
    message = partition("--dense-dtype", "int8", "--dense-dtypes", "float32,int8")
    assert "--dense-dtype int8 and --dense-dtypes float32,int8: expected one of them" in message
    with pytest.raises(UsageError, match="not both"):
        net, example = MODELS["shared"].factory(scale=SCALE)
        cleave.partition(net, example, dense_dtype="int8", dense_dtypes=["int8"])


# -- the ranker -----------------------------------------------------------------------------


def test_a_ranker_serves_the_fastest_approved_dtype_and_reports_it(roles):
    several, approved, refused = roles["dir"], roles["approved"], roles["refused"]
    queue = LocalQueue()
    batcher = load_ranker(several, queue, threads=1)
    choice = batcher.dense_choice
    assert choice.chosen_by == "probe" and choice.dtype in ("float32", approved)
    assert set(choice.seconds) == {"float32", approved} and choice.rows >= 100
    assert choice.dtype == choose(choice.seconds)
    probes = Probes(batcher)
    try:
        status, text = get(f"{probes.address}/metrics")
    finally:
        probes.close()
    assert status == 200
    assert f'cleave_ranker_dense_dtype{{chosen_by="probe",dtype="{choice.dtype}"}} 1.0' in text
    for dtype in ("float32", approved):
        assert re.search(rf'cleave_ranker_dense_probe_seconds{{dtype="{dtype}",rows="\d+"}}', text)
    # Asked for: served without a probe; a refused dtype is not served.
    forced = load_ranker(several, LocalQueue(), threads=1, dense_dtype="float32").dense_choice
    assert forced == DenseChoice("float32", "flag")
    with pytest.raises(UsageError, match=f"--dense-dtype {refused}: the bundle approves"):
        load_ranker(several, LocalQueue(), threads=1, dense_dtype=refused)


def test_rankers_of_a_deployment_serve_the_first_ones_choice(several):
    body = _body(several)
    with ServeProcess(several, "--rankers", "2", "--threads", "1") as server:
        served = {}
        for role, text in _ranker_metrics(server).items():
            found = re.search(r'cleave_ranker_dense_dtype{chosen_by="(\w+)",dtype="(\w+)"}', text)
            served[role] = found.groups()
        assert served["ranker-0"][0] == "probe" and served["ranker-1"][0] == "flag"
        assert served["ranker-0"][1] == served["ranker-1"][1]
        line = f"dense dtype {served['ranker-0'][1]} (chosen by probe: "
        assert any(line in text for text in server.log), list(server.log)[-20:]
        # The same request answered by either ranker scores the same.
        replies = [post(f"{server.url}/v2/models/shared/infer", body) for _ in range(6)]
        assert all(status == 200 for status, _ in replies)
        assert len({str(reply["outputs"]) for _, reply in replies}) == 1


def test_an_explicit_dtype_wins_for_the_whole_deployment(several):
    flags = ["--rankers", "2", "--threads", "1", "--dense-dtype", "float32"]
    with ServeProcess(several, *flags) as server:
        texts = _ranker_metrics(server)
    assert len(texts) == 2
    for text in texts.values():
        assert 'cleave_ranker_dense_dtype{chosen_by="flag",dtype="float32"} 1.0' in text


def _ranker_metrics(server: ServeProcess) -> dict[str, str]:
    """Each ranker's /metrics text, by role name (from the launcher's "metrics" lines)."""
    wait_for(lambda: printed_all_metrics(list(server.log)), "the launcher's metrics lines")
    endpoints = metrics_endpoints(list(server.log), server.url)
    return {role: get(url)[1] for role, url in endpoints.items() if role.startswith("ranker-")}


def _body(bundle_dir) -> bytes:
    from cleave.bench.loadgen import infer_body

    bundle = cleave.load_bundle(bundle_dir, verify=False)
    args = RequestGenerator("shared", scale=SCALE, seed=3).batch(8)
    return infer_body(bundle.named_inputs(*args))


# -- cleave bench serve ---------------------------------------------------------------------


def test_bench_serve_without_a_dtype_serves_the_choice_and_float32_from_one_bundle(tmp_path):
    import argparse

    from cleave.bench import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(
        ["--quick", "--model", "shared", "--scale", str(SCALE), "--candidates", "16"]
        + ["--requests", "2", "--workdir", str(tmp_path)]
    )
    serve._check_args(args)
    workload = serve.Workload(args)
    assert workload.served_dtypes == ALL  # the reference model's labelled set approves all
    targets = serve._targets(args, workload, {})
    assert list(targets) == ["disaggregated", "disaggregated-float32"]
    main, fp32 = targets.values()
    assert main.bundle == fp32.bundle == workload.bundle_dir
    assert "--dense-dtype" not in main.flags  # the rankers choose
    assert fp32.flags[-2:] == ["--dense-dtype", "float32"] and fp32.want_model
    # Responses are checked against the bundle's reference at the dtype the rankers serve.
    bf16 = workload.bundle.reference(*workload.inputs[0], dtype="bfloat16")
    response = {"outputs": [{"shape": list(bf16.shape), "data": bf16.reshape(-1).tolist()}]}
    assert workload.check(0, response, dtype="bfloat16") <= 1e-6
    assert workload.check(0, response, dtype="float32") > 1e-6
    assert 0 < workload.distance_for["bfloat16"] <= 0.02
    # Each dtype's roofline: the one the rankers serve is reported once they chose.
    assert {d: r["dtype"] for d, r in workload.roofline["by_dtype"].items()} == {d: d for d in ALL}
