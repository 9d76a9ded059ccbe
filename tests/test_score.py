"""`cleave score`: Parquet in, scores out, over one process or ranks with the tables split
among them and a bounded-lag alltoallv between them (docs/score.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import cleave
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from cleave.bench.loadgen import infer_body, outputs_of
from cleave.errors import UsageError
from cleave.launch.process import ServeProcess
from cleave.models import MODELS, RequestGenerator
from cleave.models import torchrec_models as tm
from cleave.score import job as score_job
from cleave.score.input import Schema
from support.bench import run_bench
from support.client import post
from support.processes import Process, cli, processes_below
from support.score import run_score, scores, write_input
from support.sequences import SEQUENCE_ROWS, sequence_model, sequence_requests
from support.served import SCALES, TOLERANCE, roomy_budget
from support.waiting import wait_for

pytestmark = pytest.mark.filterwarnings(
    "ignore:The given buffer is not writable", "ignore::DeprecationWarning", "ignore::UserWarning"
)

BATCH = 8  # rows per batch: not a divisor of the row groups (37 rows) nor of the rows


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict:
    """The `shared` reference model (weighted, mean, max and fixed bags) and 203 of its
    samples written as cleave score's input, with its own scores."""
    root = tmp_path_factory.mktemp("score")
    model, example = MODELS["shared"].factory(scale=SCALES["shared"], seed=0)
    model.eval()
    bundle = cleave.partition(model, example)
    generator = RequestGenerator("shared", scale=SCALES["shared"], seed=7, min_pooling=0)
    batches = [generator.batch(n) for n in (64, 64, 75)]
    data = root / "samples.parquet"
    want = write_input(bundle, model, batches, data, row_group=37)
    return {
        "dir": bundle.save(root / "shared"),
        "bundle": bundle,
        "batches": batches,
        "input": data,
        "want": want,
    }


@pytest.fixture(scope="module")
def two_ranks(shared, tmp_path_factory) -> np.ndarray:
    """A clean run over two synchronous ranks (lag 0): the scores every other run equals."""
    out = tmp_path_factory.mktemp("clean") / "scores.parquet"
    done = run_score(*_args(shared, out), "--ranks", "2", "--lag", "0", "--threads", "1")
    assert done.returncode == 0, done.stderr
    return out


def _args(shared, out) -> list[str]:
    return [
        str(shared["dir"]),
        "--input",
        str(shared["input"]),
        "--output",
        str(out),
        "--batch-size",
        str(BATCH),
    ]


def _score(bundle_dir, data, out, **options) -> dict:
    job, _ = score_job.prepare(bundle_dir, data, out, batch_size=BATCH, **options)
    return score_job.run(job, processes=False)


def test_print_schema_names_every_column(shared):
    done = run_score(str(shared["dir"]), "--print-schema")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    for line in ("term_ids_0 ", "term_weights_0 ", "page_ids ", "slot_ids ", "dense_x "):
        assert line in text
    assert "list<float>[8]" in text  # dense_x: 8 floats a row
    assert "term_offsets_0" not in text  # offsets come from the lists' lengths
    assert "output_0" in text and "row " in text


def test_one_process_scores_like_the_model(shared, tmp_path):
    out = tmp_path / "scores.parquet"
    summary = _score(shared["dir"], shared["input"], out)
    assert summary["rows"] == len(shared["want"]) == 203
    table = pq.read_table(out)
    assert table.column("row").to_pylist() == list(range(203))
    assert np.abs(scores(out) - shared["want"]).max() <= TOLERANCE
    assert not out.with_name(out.name + ".progress").exists()


def test_kjt_and_id_transforms_and_a_key_column(tmp_path):
    """TorchRec's weighted DLRM_DCN (a KJT input: a list column per key) and the reference
    DLRM (ids taken modulo the table's rows), with a key column copied through."""
    spec = tm.small(weighted=True)
    model, example = tm.build("dlrm_dcn", spec)
    generator = torch.Generator().manual_seed(5)
    cases = [
        (model, example, [tm.requests(spec, b, generator) for b in (9, 30)], "kjt"),
        (*MODELS["dlrm"].factory(scale=SCALES["dlrm"], seed=0), None, "dlrm"),
    ]
    for model, example, batches, name in cases:
        model.eval()
        bundle = cleave.partition(model, example)
        if batches is None:
            generator_d = RequestGenerator("dlrm", scale=SCALES["dlrm"], seed=3, min_pooling=0)
            batches = [generator_d.batch(20)]
        data = tmp_path / f"{name}.parquet"
        want = write_input(bundle, model, batches, data, row_group=16)
        table = pq.read_table(data)
        keyed = table.append_column("sample", pa.array([f"s{i}" for i in range(len(want))]))
        pq.write_table(keyed, data, row_group_size=16)
        if name == "kjt":
            p = bundle.manifest["kjts"][0]["name"]
            assert {f"{p}.user", f"{p}.user.weights", f"{p}.seen_item"} <= set(table.column_names)
        out = tmp_path / f"{name}-scores.parquet"
        _score(bundle.save(tmp_path / name), data, out, key="sample")
        got = pq.read_table(out)
        assert got.column_names == ["sample", "output_0"]
        assert got.column("sample").to_pylist() == [f"s{i}" for i in range(len(want))]
        assert np.abs(scores(out) - want).max() <= TOLERANCE, name


def test_two_ranks_score_like_the_model_and_like_one_process(shared, two_ranks, tmp_path):
    assert np.abs(scores(two_ranks) - shared["want"]).max() <= TOLERANCE
    one = tmp_path / "one.parquet"
    _score(shared["dir"], shared["input"], one)
    assert pq.read_table(one).equals(pq.read_table(two_ranks))  # bit for bit


def test_torchrun_ranks_write_the_same_scores(shared, two_ranks, tmp_path):
    """torchrun's own rendezvous (`--standalone`: its store on a port it binds itself), every
    process a rank, at a lag: the file two `--ranks` ranks wrote, bit for bit."""
    out = tmp_path / "scores.parquet"
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--standalone"]
    command = [*torchrun, "--nproc-per-node", "2", "--no-python", *cli("score")]
    done = subprocess.run(
        [*command, *_args(shared, out), "--lag", "2", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},  # one machine: loopback
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("2 rank(s), lag 2") == 1  # one job of two ranks: rank 0 reports
    assert pq.read_table(out).equals(pq.read_table(two_ranks))


def test_served_online_the_rows_score_as_cleave_score_scores_them(shared, two_ranks, tmp_path):
    """`cleave serve` with its shards holding the tables the two ranks held (the planner's
    whole-table layout) answers the input's samples with the scores cleave score wrote."""
    layout = ["--shards", "2", "--table-layout", "tables", "--threads", "1"]
    with ServeProcess(shared["dir"], *layout, *roomy_budget(tmp_path)) as server:
        url = f"{server.url}/v2/models/{shared['dir'].name}/infer"
        got = []
        for args in shared["batches"]:
            status, reply = post(url, infer_body(shared["bundle"].named_inputs(*args)))
            assert status == 200, reply
            got.append(np.concatenate([o.reshape(len(o), -1) for o in outputs_of(reply)], 1))
    assert np.abs(np.concatenate(got) - scores(two_ranks)).max() <= TOLERANCE


def _bad_inputs(shared, tmp_path) -> list[tuple[Path, str, str]]:
    """(input file, output, the words the error must have) for each kind of bad input."""
    good = pq.read_table(shared["input"])
    cases = []

    def case(name, table, words, output=None):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(table, path, row_group_size=50)
        out = output or tmp_path / f"{name}-out.parquet"
        cases.append((path, out, [str(output or path), *words]))

    case("missing", good.drop_columns(["page_ids"]), ["no column 'page_ids'"])
    wrong = good.set_column(
        good.column_names.index("dense_x"),
        "dense_x",
        pa.array([[str(v) for v in row] for row in good.column("dense_x").to_pylist()]),
    )
    case("wrong_type", wrong, ["column 'dense_x' is list<element: string>", "list<float>[8]"])
    ids = good.column("ad_ids").to_pylist()
    ids[121] = [3, 5000]  # the ads table has 5000 rows
    case(
        "out_of_range",
        good.set_column(good.column_names.index("ad_ids"), "ad_ids", pa.array(ids)),
        ["column 'ad_ids', row 121", "id 5000", "table 'ads'", "[0, 5000)"],
    )
    dense = good.column("dense_x").to_pylist()
    dense[77] = dense[77][:5]
    case(
        "short_list",
        good.set_column(
            good.column_names.index("dense_x"), "dense_x", pa.array(dense, pa.list_(pa.float32()))
        ),
        ["column 'dense_x', row 77", "5 elements, expected 8"],
    )
    pages = good.column("page_ids").to_pylist()
    pages[150] = None
    case(
        "null",
        good.set_column(
            good.column_names.index("page_ids"), "page_ids", pa.array(pages, pa.list_(pa.int64()))
        ),
        ["column 'page_ids', row 150: null"],
    )
    case("empty", good.slice(0, 0), ["no rows"])
    case(
        "no_dir",
        good,
        ["cannot be written", "does not exist"],
        output=tmp_path / "missing-dir" / "out.parquet",
    )
    return cases


def test_bad_input_is_refused_before_any_rank_starts(shared, tmp_path):
    for data, out, words in _bad_inputs(shared, tmp_path):
        with pytest.raises(UsageError) as err:
            score_job.prepare(shared["dir"], data, out, ranks=2)
        for word in words:
            assert word in str(err.value), (word, str(err.value))
        assert not out.exists() and not out.with_name(out.name + ".progress").exists()
    # through the command line: exit code 2 and the message, no rank started
    data, out, words = _bad_inputs(shared, tmp_path)[2]
    done = run_score(str(shared["dir"]), "--input", str(data), "--output", str(out), "--ranks", "2")
    assert done.returncode == 2
    assert "cleave score: error:" in done.stderr and words[1] in done.stderr


def test_a_killed_rank_fails_the_job_and_a_rerun_resumes_bit_for_bit(shared, two_ranks, tmp_path):
    out = tmp_path / "scores.parquet"
    args = [*_args(shared, out), "--ranks", "2", "--lag", "2", "--threads", "1", "--chunk", "2"]
    # rank 1 sleeps 0.3 s a batch, so the job still runs for seconds when its first chunks are in
    job = Process(cli("score", *args, "--inject", "straggler:0.3"), name="cleave score")
    progress = out.with_name(out.name + ".progress")
    wait_for(
        lambda: len(list(progress.glob("rank*-chunk000000.parquet"))) == 2,
        "both ranks' first chunk",
        240,
    )
    rank1 = next(
        pid
        for pid, argv in processes_below(job.proc.pid).items()
        if "cleave.score.pipeline" in argv and argv[argv.index("--rank") + 1] == "1"
    )
    os.kill(rank1, signal.SIGKILL)
    assert job.proc.wait(60) == 2
    job.stop()
    text = job.output()
    assert f"rank 1 (pid {rank1}) during batch" in text and "killed by SIGKILL" in text, text
    assert not out.exists() and progress.exists()
    rerun = run_score(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert "resuming from iteration " in rerun.stderr, rerun.stderr
    assert "resuming from iteration 0 " not in rerun.stderr
    assert out.read_bytes() == two_ranks.read_bytes()  # the file a clean run writes
    assert not progress.exists()


def test_bench_score_reports_cases_against_lag_0_one_rank_and_the_online_path(tmp_path):
    """`cleave bench score` end to end, smallest: one and two ranks, random delays, lags 0
    and 1, two independent one-rank jobs at once (their rows and rates summed, each writing
    what the ranks write), and the online path (`--online`: the same bundle served, its rows/s
    within budget) against one process on every core."""
    flags = ["--quick", "--model", "shared", "--scale", "0.01", "--ranks", "1,2", "--online"]
    flags += ["--imbalance", "random_delay", "--lags", "0,1", "--rows", "512", "--independent"]
    _, report = run_bench(tmp_path, "score", *flags)
    cases, cores = report["cases"], len(os.sched_getaffinity(0))
    assert [(c["imbalance"], c["ranks"], c["lag"], c["threads"]) for c in cases] == [
        ("random_delay", 1, 0, 1),
        ("random_delay", 2, 0, 1),
        ("random_delay", 2, 1, 1),
        ("random_delay", 2, None, 1),
        ("balanced", 1, 0, cores),  # the online path's reference
    ]
    for c in cases:
        assert c["per_batch_s"] > 0 and c["cpu_us_per_row"] > 0
        assert c["same_scores_as_lag0"]  # 1 and 2 ranks, every lag, each job: the same bytes
    assert all(c["mean_delay_s"] > 0 for c in cases[:4]) and cases[4]["mean_delay_s"] == 0
    assert [c["rows"] for c in cases] == [512, 512, 512, 2 * 512, 512]
    one, two = cases[0]["rows_per_s"], cases[1]["rows_per_s"]
    assert cases[1]["speedup_over_1_rank"] == pytest.approx(two / one)
    assert "speedup_over_1_rank" not in cases[0]
    assert cases[2]["bound_s"] == pytest.approx(report["delay_s"] / 3)
    assert cases[3]["kind"] == "independent" and len(cases[3]["per_batch_by_rank_s"]) == 2
    online, whole = report["online"], cases[4]
    assert online["deployment"].startswith("disaggregated") and online["candidates"] == 100
    # a loaded machine may miss the budget at every rate of the quick sweep: 0 rows/s then
    assert online["rows_per_s"] == online["max_rate_within_budget"] * 100
    assert online["budget_ms"] > 0 and online["rank1_threads"] == cores
    if online["rows_per_s"]:
        ratio = report["ratios"]["rank1_over_online"]
        assert ratio == pytest.approx(whole["rows_per_s"] / online["rows_per_s"])
    assert (tmp_path / "score.png").exists()


def test_tables_cut_into_row_ranges_score_like_the_model_at_every_lag(shared, tmp_path):
    """`--table-layout rows` (every table cut over the ranks, as the planner cuts it over
    shards): bags cut along the ranges, pooled partially (weighted sums, a mean, a max) and
    merged, within the tolerance of the model, and bit for bit the same at every lag."""
    for lag in (0, 2):
        job, _ = score_job.prepare(
            shared["dir"], shared["input"], tmp_path / f"rows-{lag}.parquet", ranks=2, lag=lag,
            batch_size=BATCH, threads=1, table_layout="rows",
        )  # fmt: skip
        score_job.run(job, processes=True)
    assert pq.read_table(tmp_path / "rows-0.parquet").equals(pq.read_table(job.output))
    assert np.abs(scores(tmp_path / "rows-0.parquet") - shared["want"]).max() <= TOLERANCE


class _Gathers(torch.nn.Module):
    """Three ids per sample, each gathered (pooling none) from a 50-row table, and a bag."""

    def __init__(self):
        super().__init__()
        self.rows = torch.nn.Embedding(50, 4)
        self.bag = torch.nn.EmbeddingBag(30, 4, mode="max")
        self.top = torch.nn.Linear(3 * 4 + 4 + 2, 1)

    def forward(self, ids, bag_ids, bag_offsets, x):
        gathered = self.rows(ids).flatten(1)
        return torch.sigmoid(self.top(torch.cat([gathered, self.bag(bag_ids, bag_offsets), x], 1)))


def test_gathered_rows_of_a_cut_table_come_back_in_place(tmp_path):
    """Per-position gathers (pooling none, their count per sample a model symbol) in one
    process, and from a table cut over two ranks: each id's row from the rank holding it,
    put back at its position."""
    torch.manual_seed(0)
    model = _Gathers().eval()
    g = torch.Generator().manual_seed(3)

    def batch(n):
        lengths = torch.randint(0, 4, (n,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        bag_ids = torch.randint(0, 30, (int(lengths.sum()),), generator=g)
        return torch.randint(0, 50, (n, 3), generator=g), bag_ids, offsets, torch.randn(n, 2)

    bundle = cleave.partition(model, batch(4))
    assert [f["pooling"] for f in bundle.manifest["features"]] == ["none", "max"]
    data = tmp_path / "gathers.parquet"
    want = write_input(bundle, model, [batch(20), batch(13)], data, row_group=16)
    one = tmp_path / "one.parquet"
    _score(bundle.save(tmp_path / "gathers"), data, one)
    assert np.abs(scores(one) - want).max() <= TOLERANCE
    out = tmp_path / "scores.parquet"
    job, _ = score_job.prepare(
        tmp_path / "gathers",
        data,
        out,
        ranks=2,
        batch_size=BATCH,
        table_layout="rows",
        threads=1,
    )
    score_job.run(job, processes=True)
    assert np.abs(scores(out) - want).max() <= TOLERANCE


def test_an_embedding_collection_scores_like_the_torchrec_model(tmp_path):
    """TorchRec's EmbeddingCollection (keys read row by row, their rows [ids in the batch, dim]
    across the seam, the KJT's lengths per key) beside an EmbeddingBagCollection: two ranks at
    a lag score like the model."""
    model, example = sequence_model(padded=True, bags=True)
    bundle = cleave.partition(model, example)
    schema = Schema(bundle.manifest)
    keys = ("seen", "city", "user", "item")
    assert schema.key_lengths == {f"kjt.lengths.{k}": f"kjt.{k}" for k in keys}
    assert [f.shape for f in schema.features] == [None, None, None, ()]  # user is pooled
    generator = torch.Generator().manual_seed(6)
    batches = [sequence_requests(True, n, generator) for n in (11, 30)]
    data = tmp_path / "sequences.parquet"
    want = write_input(bundle, model, batches, data, row_group=16)
    assert set(SEQUENCE_ROWS) <= {c.split(".")[-1] for c in pq.read_table(data).column_names}
    directory = bundle.save(tmp_path / "sequences")
    out = tmp_path / "scores.parquet"
    job, _ = score_job.prepare(directory, data, out, ranks=2, lag=1, batch_size=BATCH, threads=1)
    score_job.run(job, processes=True)
    assert np.abs(scores(out) - want).max() <= TOLERANCE


def test_per_request_inputs_score_each_request_as_the_model_does(tmp_path):
    """`din`: a user's history and profile bag, looked up once per request, are columns
    holding the request's value in each of its rows; a run of equal ones is one request
    (cut where a batch ends: the batches of 8 rows split two of them). One process, then two
    ranks at lag 2 with the item table cut between them: like the model."""
    model, example = MODELS["din"].factory(scale=SCALES["din"], seed=0)
    bundle = cleave.partition(model.eval(), example)
    schema = Schema(bundle.manifest)
    assert schema.request_columns == ["user_hist", "profile_ids"]
    assert "profile_ids    list<int64>" in schema.describe()
    generator = RequestGenerator("din", scale=SCALES["din"], seed=5)
    batches = [generator.batch(n) for n in (3, 1, 12, 5, 9)]
    data = tmp_path / "users.parquet"
    want = write_input(bundle, model, batches, data, row_group=7)
    directory = bundle.save(tmp_path / "din")
    one = tmp_path / "one.parquet"
    _score(directory, data, one)
    assert np.abs(scores(one) - want).max() <= TOLERANCE
    out = tmp_path / "ranks.parquet"
    options = {"ranks": 2, "lag": 2, "table_layout": "rows", "threads": 1}
    job, _ = score_job.prepare(directory, data, out, batch_size=BATCH, **options)
    score_job.run(job, processes=True)
    assert np.abs(scores(out) - want).max() <= TOLERANCE


class _UserVector(torch.nn.Module):
    """A per-request dense input (one user's features, [1, 4]) beside per-candidate ids."""

    def __init__(self):
        super().__init__()
        self.items = torch.nn.Embedding(40, 4)
        self.top = torch.nn.Linear(8, 1)

    def forward(self, user, items):
        joined = torch.cat([user.expand(items.shape[0], 4), self.items(items)], 1)
        return torch.sigmoid(self.top(joined))


def test_a_per_request_dense_input_is_read_from_its_requests_rows(tmp_path):
    torch.manual_seed(0)
    model = _UserVector().eval()
    g = torch.Generator().manual_seed(1)

    def request(n):
        return torch.randn(1, 4, generator=g), torch.randint(0, 40, (n,), generator=g)

    bundle = cleave.partition(model, request(5))
    assert Schema(bundle.manifest).request_columns == ["user"]
    data = tmp_path / "users.parquet"
    want = write_input(bundle, model, [request(n) for n in (3, 6, 2, 9)], data, row_group=5)
    out = tmp_path / "scores.parquet"
    _score(bundle.save(tmp_path / "user"), data, out)
    assert np.abs(scores(out) - want).max() <= TOLERANCE
