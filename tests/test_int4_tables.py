"""int4 row-wise tables from the partitioner (docs/bundle.md): Python writes them, the Rust
engine reads the same values, and `cleave serve` of such a bundle answers like the bundle's
own reference executor."""

from __future__ import annotations

import cleave
import numpy as np
import pytest
import torch
from cleave._native import TableSet
from cleave.bench.loadgen import infer_body, outputs_of
from cleave.bundle import tables as table_io
from cleave.launch.process import ServeProcess
from cleave.models import MODELS, RequestGenerator
from support.client import post
from support.served import SCALES, TOLERANCE


def test_int4_codes_round_trip_and_pack_two_a_byte():
    w = np.array([[-1.0, 1.0, 0.6, -0.2, 0.2], [2.0] * 5, [0.0] * 5], dtype=np.float32)
    raw = table_io.encode(w, "int4_rowwise")
    assert raw.shape == (3, table_io.row_bytes("int4_rowwise", 5)) == (3, 3 + 8)
    # Row 0: min -1, max 1, scale 2/15, so codes 0, 15, 12, 6, 9; the even element low.
    assert list(raw[0, :3]) == [0 | 15 << 4, 12 | 6 << 4, 9]
    assert np.abs(table_io.decode(raw, "int4_rowwise", 5) - w).max() <= 1 / 15 + 1e-6
    assert (table_io.decode(raw, "int4_rowwise", 5)[1] == 2.0).all()  # constant rows exact


@pytest.mark.slow  # a deployment
def test_the_engine_reads_what_python_wrote_and_serve_answers_like_the_reference(tmp_path):
    model, example = MODELS["dlrm"].factory(scale=SCALES["dlrm"], seed=1)
    model.eval()
    bundle = cleave.partition(model, example, table_dtype="int4_rowwise")
    directory = bundle.save(tmp_path / "dlrm")
    tables = TableSet.open(directory)
    for meta in bundle.manifest["tables"]:
        assert meta["dtype"] == "int4_rowwise"
        assert meta["row_bytes"] == (meta["dim"] + 1) // 2 + 8
        raw = table_io.open_rows(directory / meta["file"], meta)
        ids = np.arange(min(meta["rows"], 64), dtype=np.int64)
        want = table_io.decode(np.asarray(raw[ids]), "int4_rowwise", meta["dim"])
        np.testing.assert_array_equal(tables.gather(meta["name"], ids), want)
    generator = RequestGenerator("dlrm", scale=SCALES["dlrm"], seed=3, min_pooling=0)
    batches = [generator.batch(b) for b in (1, 16)]
    with ServeProcess(directory, "--shards", "1", "--rankers", "1", "--threads", "1") as server:
        url = f"{server.url}/v2/models/{directory.name}/infer"
        for args in batches:
            status, reply = post(url, infer_body(bundle.named_inputs(*args)))
            assert status == 200, reply
            with torch.inference_mode():
                want = bundle.reference(*args).double().numpy()
            (got,) = outputs_of(reply)
            assert np.abs(got - want.reshape(got.shape)).max() <= TOLERANCE
