"""TorchRec models, unmodified, from KeyedJaggedTensor to scores: torchrec.models' DLRM,
DLRM_DCN, DLRM_Projection and SimpleDeepFMNN partitioned and served by `cleave serve`, their
KJT sent as `p.values`/`p.lengths`/`p.weights` over REST JSON, binary tensors and gRPC, and
the scores equal to the model's eager output within 1e-5 for batch sizes not exported with.
Bad KJTs get a 400 naming the input and key; a model that rewrites ids between the KJT and its
lookups is refused at partition time (docs/models.md, "TorchRec models")."""

from __future__ import annotations

import json
import urllib.request

import cleave
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from cleave.bench.loadgen import infer_body
from cleave.client import request_body, request_inputs
from cleave.errors import UnsupportedModelError
from cleave.launch.process import ServeProcess
from cleave.models import torchrec_models as tm
from support.client import post
from support.sequences import sequence_model, sequence_requests
from support.served import TOLERANCE, check_outputs, grpc_target, roomy_budget
from support.triton import triton_inputs
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.filterwarnings(
    "ignore:The given buffer is not writable", "ignore::DeprecationWarning", "ignore::UserWarning"
)

BATCHES = (1, 7, 33)  # the example has 4 samples


def scores(model, args) -> list[np.ndarray]:
    with torch.inference_mode():
        return [model(*args).double().numpy()]


def offsets_form(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The same KJT built from offsets instead of lengths."""
    return KeyedJaggedTensor(
        keys=kjt.keys(), values=kjt.values(), weights=kjt.weights_or_none(), offsets=kjt.offsets()
    )


@pytest.mark.parametrize(
    "name, weighted",
    [("dlrm", False), ("dlrm_dcn", True), ("dlrm_projection", False), ("deepfm", True)],
)
def test_bundle_scores_like_the_torchrec_model(name, weighted):
    """Partitioned as it is (shared table, key order unlike the tables', mean and sum,
    weighted or not), the bundle's reference execution scores any batch size as TorchRec does,
    with KJTs built from lengths or from offsets."""
    spec = tm.small(weighted)
    model, example = tm.build(name, spec)
    bundle = cleave.partition(model, example)
    kjt = bundle.manifest["kjts"][0]
    assert kjt["keys"] == list(spec.key_order)
    assert (kjt["weights"] is not None) == weighted
    by_key = {f["key"]: f["table"] for f in bundle.manifest["features"]}
    assert by_key["item"] == by_key["seen_item"] != by_key["user"]  # one table, two keys
    generator = torch.Generator().manual_seed(11)
    for batch in BATCHES:
        dense, kjt = tm.requests(spec, batch, generator)
        want = scores(model, (dense, kjt))[0]
        for form in (kjt, offsets_form(kjt)):
            got = bundle.reference(dense, form).double().numpy()
            assert np.abs(got - want).max() <= TOLERANCE, (name, batch)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """TorchRec's weighted DLRM_DCN served with two shards and gRPC, and requests of batch
    sizes the export did not see with the model's scores."""
    root = tmp_path_factory.mktemp("torchrec")
    spec = tm.small(weighted=True)
    model, example = tm.build("dlrm_dcn", spec)
    bundle_dir = cleave.partition(model, example).save(root / "tr_dcn")
    generator = torch.Generator().manual_seed(5)
    requests = [tm.requests(spec, b, generator) for b in BATCHES]
    flags = ["--shards", "2", "--rankers", "1", "--threads", "1", "--grpc-port", "0"]
    with ServeProcess(bundle_dir, *flags, *roomy_budget(root)) as server:
        yield server, bundle_dir, model, requests


def test_served_scores_over_json_binary_and_grpc(deployment):
    server, bundle_dir, model, requests = deployment
    name = bundle_dir.name
    url = f"{server.url}/v2/models/{name}/infer"
    for args in requests:
        want = scores(model, args)
        status, reply = post(url, request_body(bundle_dir, *args))
        assert status == 200, reply
        check_outputs(reply, want, ("json", args[0].shape[0]))
        # The same KJT built from offsets sends the same tensors.
        status, reply = post(url, request_body(bundle_dir, args[0], offsets_form(args[1])))
        assert status == 200, reply
        check_outputs(reply, want, ("json, offsets", args[0].shape[0]))
        arrays = {k: v.numpy() for k, v in request_inputs(bundle_dir, *args).items()}
        http = httpclient.InferenceServerClient(url=server.url.removeprefix("http://"))
        result = http.infer(name, triton_inputs(httpclient, arrays))  # binary tensors
        assert np.abs(result.as_numpy("output_0") - want[0]).max() <= TOLERANCE
        with grpcclient.InferenceServerClient(url=grpc_target(server)) as rpc:
            result = rpc.infer(name, triton_inputs(grpcclient, arrays))
            assert np.abs(result.as_numpy("output_0") - want[0]).max() <= TOLERANCE
            # TorchRec's INT32 values and lengths are taken as they are.
            narrow = {
                k: v.astype(np.int32) if v.dtype == np.int64 else v for k, v in arrays.items()
            }
            result = rpc.infer(name, triton_inputs(grpcclient, narrow))
            assert np.abs(result.as_numpy("output_0") - want[0]).max() <= TOLERANCE
        result = http.infer(name, triton_inputs(httpclient, narrow))
        assert np.abs(result.as_numpy("output_0") - want[0]).max() <= TOLERANCE
        narrow = {k: torch.from_numpy(v) for k, v in narrow.items()}
        status, reply = post(url, infer_body(narrow))
        assert status == 200, reply
        check_outputs(reply, want, ("json, int32", args[0].shape[0]))


@pytest.mark.parametrize(
    "name, weighted, mode",
    [
        ("dlrm", False, "--monolithic"),
        ("dlrm_projection", True, "--router-held"),
        ("deepfm", False, None),
    ],
)
def test_each_architecture_serves_torchrecs_scores(tmp_path, name, weighted, mode):
    """The other architectures, one deployment each, over REST JSON; also the monolithic
    baseline and the tables held by the router."""
    spec = tm.small(weighted)
    model, example = tm.build(name, spec)
    bundle_dir = cleave.partition(model, example).save(tmp_path / name)
    generator = torch.Generator().manual_seed(9)
    flags = ["--shards", "1", "--rankers", "1", "--threads", "1", *([mode] if mode else [])]
    with ServeProcess(bundle_dir, *flags, *roomy_budget(tmp_path)) as server:
        for batch in (1, 33):
            args = tm.requests(spec, batch, generator)
            status, reply = post(
                f"{server.url}/v2/models/{name}/infer", request_body(bundle_dir, *args)
            )
            assert status == 200, reply
            check_outputs(reply, scores(model, args), (name, batch))


def test_metadata_lists_the_kjt_inputs_and_keys(deployment):
    server, bundle_dir, _, _ = deployment
    with urllib.request.urlopen(f"{server.url}/v2/models/{bundle_dir.name}", timeout=10) as r:
        meta = json.loads(r.read())
    inputs = {i["name"]: (i["datatype"], i["shape"]) for i in meta["inputs"]}
    assert inputs["sparse_features.values"] == ("INT64", [-1])
    assert inputs["sparse_features.weights"] == ("FP32", [-1])
    assert inputs["sparse_features.lengths"] == ("INT64", [-1])
    kjt = meta["parameters"]["kjts"]["sparse_features"]
    assert kjt["keys"] == list(tm.small().key_order)
    assert kjt["lengths"] == "sparse_features.lengths"


def bad_kjts(bundle_dir):
    """(what is wrong, named inputs, words the 400 must contain). Batch 2, keys in the order
    city, seen_item, user, item; t_city has 13 rows."""
    dense = torch.zeros(2, 5)
    lengths = torch.tensor([1, 0, 1, 1, 0, 2, 1, 0])
    values = torch.tensor([3, 60, 0, 40, 1, 66])

    def named(values=values, lengths=lengths, dense=dense):
        weights = torch.ones(values.shape)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=list(tm.small().key_order), values=values, weights=weights, lengths=lengths
        )
        return request_inputs(bundle_dir, dense, kjt)

    missing = named()
    del missing["sparse_features.lengths"]
    return [
        (
            "values shorter than the lengths",
            named(values=values[:4]),
            ["sparse_features.values", 'run out in key "user"'],
        ),
        (
            "a negative length",  # the lengths still sum to the number of values
            named(lengths=torch.tensor([1, 0, 1, 1, 0, 2, 2, -1])),
            ["sparse_features.lengths", '(key "item", sample 1) is negative'],
        ),
        ("lengths missing", missing, ["missing input", "sparse_features.lengths"]),
        ("F·B not the batch", named(dense=torch.zeros(3, 5)), ["sparse_features.lengths", "4*B"]),
        (
            "an id outside its key's table",
            named(values=torch.tensor([13, 60, 0, 40, 1, 66])),
            ["sparse_features.values", 'key "city"', "rows [0, 13)"],
        ),
    ]


def test_bad_kjts_get_a_400_naming_input_and_key(deployment):
    server, bundle_dir, model, requests = deployment
    url = f"{server.url}/v2/models/{bundle_dir.name}/infer"
    for what, named, words in bad_kjts(bundle_dir):
        status, reply = post(url, infer_body(named))
        assert status == 400, (what, reply)
        for word in words:
            assert word in reply["error"], (what, word, reply["error"])
    # Binary tensors and gRPC refuse a bad KJT the same way.
    what, named, words = bad_kjts(bundle_dir)[1]
    arrays = {k: v.numpy() for k, v in named.items()}
    http = httpclient.InferenceServerClient(url=server.url.removeprefix("http://"))
    with pytest.raises(InferenceServerException, match="negative"):
        http.infer(bundle_dir.name, triton_inputs(httpclient, arrays))
    with grpcclient.InferenceServerClient(url=grpc_target(server)) as rpc:
        with pytest.raises(InferenceServerException, match="run out in key"):
            named = bad_kjts(bundle_dir)[0][1]
            arrays = {k: v.numpy() for k, v in named.items()}
            rpc.infer(bundle_dir.name, triton_inputs(grpcclient, arrays))
    # The server is unaffected: a good request still scores.
    args = requests[1]
    status, reply = post(url, request_body(bundle_dir, *args))
    assert status == 200, reply
    check_outputs(reply, scores(model, args))


class HashedIds(torch.nn.Module):
    """Rewrites the KJT's ids before its lookups: not TorchRec's own split."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, dense, kjt):
        hashed = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values() % 11, lengths=kjt.lengths())
        return self.model(dense, hashed)


def test_the_eager_baseline_runs_the_saved_model_over_the_bundles_inputs(tmp_path):
    """`--eager-model`: the model as its author saved it, fed the bundle's flat inputs (the
    KJT rebuilt from them) scores as the model; a file that holds no module, or a model whose
    arguments are not each a tensor or a KJT, is refused saying what was expected."""
    from cleave.bundle.kjt import flat_tensors
    from cleave.errors import UsageError
    from cleave.ranker.eager import load_eager

    spec = tm.small(weighted=True)
    model, example = tm.build("dlrm_dcn", spec)
    manifest = cleave.partition(model, example).manifest
    torch.save(model, tmp_path / "model.pt")
    eager = load_eager(tmp_path / "model.pt", manifest)
    args = tm.requests(spec, 7, torch.Generator().manual_seed(2))
    with torch.inference_mode():
        (got,) = eager(*flat_tensors(args))
    assert torch.equal(got, model(*args))
    torch.save({"weights": torch.zeros(1)}, tmp_path / "state.pt")
    with pytest.raises(UsageError, match="expected a saved torch.nn.Module, got dict"):
        load_eager(tmp_path / "state.pt", manifest)
    torch.save(torch.nn.Bilinear(2, 2, 1), tmp_path / "three.pt")  # forward(input1, input2)
    with pytest.raises(
        UsageError, match=r"takes 2 arguments \(input1, input2\), but the bundle's inputs make 4"
    ):
        load_eager(tmp_path / "three.pt", {**manifest, "kjts": []})


def test_ids_rewritten_between_the_kjt_and_the_lookup_are_refused():
    model, example = tm.build("dlrm", tm.small())
    with pytest.raises(UnsupportedModelError) as err:
        cleave.partition(HashedIds(model), example)
    message = str(err.value)
    assert "aten.remainder" in message, message
    assert "test_torchrec.py" in message and "in forward" in message, message


def test_variable_batch_kjts_are_refused():
    model, (dense, kjt) = tm.build("dlrm", tm.small())
    keys = kjt.keys()
    lengths = torch.ones(len(keys) * 2 + 1, dtype=torch.int64)  # one key has 3 samples
    variable = KeyedJaggedTensor(
        keys=keys,
        values=torch.zeros(int(lengths.sum()), dtype=torch.int64),
        lengths=lengths,
        stride_per_key_per_rank=[[3]] + [[2]] * (len(keys) - 1),
    )
    with pytest.raises(UnsupportedModelError, match="variable-batch"):
        cleave.partition(model, (dense[:2], variable))


@pytest.mark.parametrize("padded, bags", [(True, True), (False, False)])
def test_embedding_collection_rows_score_like_the_torchrec_model(padded, bags):
    """An EmbeddingCollection's rows cross the seam unpooled; `to_padded_dense`'s fbgemm
    operators become ATen in the dense program. Any batch size scores as TorchRec does, and
    the ranker's join of several requests scores each as alone."""
    from cleave.ranker.signature import signature

    model, example = sequence_model(padded, bags)
    bundle = cleave.partition(model, example)
    features = {f["key"]: f for f in bundle.manifest["features"]}
    assert {k for k, f in features.items() if f["pooling"] == "none"} == {"item", "seen", "city"}
    assert features["item"]["output"] == "item_rows"
    assert features["item"]["table"] == features["seen"]["table"]
    assert ("user" in features) == bags and features.get("user", {}).get("pooling") in (
        None,
        "mean",
    )
    ops = {str(n.target) for n in bundle.dense_program.graph.nodes if n.op == "call_function"}
    assert not [op for op in ops if op.startswith("fbgemm")], ops
    generator = torch.Generator().manual_seed(11)
    requests = [sequence_requests(bags, batch, generator) for batch in BATCHES]
    for args in requests:
        got = bundle.reference(*args).double().numpy()
        assert np.abs(got - scores(model, args)[0]).max() <= TOLERANCE, args[0].shape[0]
    # The ranker joins requests: rows along their ids, the KJT's lengths key by key.
    sig = signature(bundle.manifest, monolithic=False)
    assert sig.batchable, sig.why_not
    dense_inputs = []
    for args in requests:
        values = bundle.named_inputs(*args)
        values.update(bundle.sparse_reference(values))
        dense_inputs.append([values[n] for n in bundle.manifest["dense"]["inputs"]])
    rows = [sig.rows(tensors) for tensors in dense_inputs]
    assert rows == list(BATCHES)
    module = bundle.dense_module()
    with torch.inference_mode():
        joined = sig.split(list(module(*sig.join(dense_inputs))), rows)
    for args, (got,) in zip(requests, joined, strict=True):
        assert np.abs(got.double().numpy() - scores(model, args)[0]).max() <= TOLERANCE


class PaddedOnly(torch.nn.Module):
    """Two keys of an EmbeddingCollection padded by `to_padded_dense`, and no other input:
    the batch is known only from the KJT's lengths."""

    def __init__(self):
        super().__init__()
        table = EmbeddingConfig(
            name="t", embedding_dim=4, num_embeddings=10, feature_names=["f", "g"]
        )
        self.collection = EmbeddingCollection(tables=[table])
        self.top = torch.nn.Linear(4, 1)

    def forward(self, kjt):
        rows = self.collection(kjt)
        return self.top(rows["f"].to_padded_dense(3).sum(1) - rows["g"].to_padded_dense(2)[:, 1])


def test_an_embedding_collection_alone_scores_any_batch():
    model = PaddedOnly().eval()
    lengths = torch.tensor([1, 2, 1, 0, 0, 0])  # key g has no id in the example
    example = KeyedJaggedTensor(keys=["f", "g"], values=torch.arange(4), lengths=lengths)
    bundle = cleave.partition(model, (example,))
    generator = torch.Generator().manual_seed(4)
    for batch in BATCHES:
        lengths = torch.randint(0, 5, (2 * batch,), generator=generator)
        values = torch.randint(0, 10, (int(lengths.sum()),), generator=generator)
        kjt = KeyedJaggedTensor(keys=["f", "g"], values=values, lengths=lengths)
        got = bundle.reference(kjt).double().numpy()
        assert np.abs(got - scores(model, (kjt,))[0]).max() <= TOLERANCE, batch
    # Offline scoring reads the KJT as a list column per key, and gives back its lengths.
    from cleave.score.input import Schema

    schema = Schema(bundle.manifest)
    assert list(schema.columns) == ["kjt.f", "kjt.g"]
    assert schema.key_lengths == {"kjt.lengths.f": "kjt.f", "kjt.lengths.g": "kjt.g"}


def test_embedding_collections_serve_torchrecs_scores(tmp_path):
    """An EmbeddingCollection padded by `to_padded_dense`, beside an EmbeddingBagCollection,
    served by `cleave serve` over REST JSON and binary tensors."""
    model, example = sequence_model(padded=True, bags=True)
    bundle_dir = cleave.partition(model, example).save(tmp_path / "sequences")
    generator = torch.Generator().manual_seed(9)
    flags = ["--shards", "2", "--rankers", "1", "--threads", "1"]
    with ServeProcess(bundle_dir, *flags, *roomy_budget(tmp_path)) as server:
        http = httpclient.InferenceServerClient(url=server.url.removeprefix("http://"))
        for batch in (1, 33):
            args = sequence_requests(True, batch, generator)
            want = scores(model, args)
            status, reply = post(
                f"{server.url}/v2/models/sequences/infer", request_body(bundle_dir, *args)
            )
            assert status == 200, reply
            check_outputs(reply, want, batch)
            arrays = {k: v.numpy() for k, v in request_inputs(bundle_dir, *args).items()}
            result = http.infer("sequences", triton_inputs(httpclient, arrays))
            assert np.abs(result.as_numpy("output_0") - want[0]).max() <= TOLERANCE


class OtherFbgemm(torch.nn.Module):
    """An EmbeddingCollection whose rows go through an fbgemm operator Cleave has no ATen
    form of."""

    def __init__(self):
        super().__init__()
        table = EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])
        self.collection = EmbeddingCollection(tables=[table])
        self.top = torch.nn.Linear(4, 1)

    def forward(self, kjt):
        jt = self.collection(kjt)["f"]
        padded = torch.ops.fbgemm.jagged_2d_to_dense(jt.values(), jt.offsets(), 3)
        return self.top(padded.sum(1))


def test_embedding_collection_rows_through_another_fbgemm_operator_are_refused():
    kjt = KeyedJaggedTensor(
        keys=["f"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 2, 1])
    )
    with pytest.raises(UnsupportedModelError, match="EmbeddingCollection, unpooled") as err:
        cleave.partition(OtherFbgemm().eval(), (kjt,))
    message = str(err.value)
    assert "aten.embedding" in message, message
    # Named by its fbgemm operator, and where the model calls it.
    assert "through fbgemm.jagged_2d_to_dense" in message, message
    assert "test_torchrec.py" in message and "in forward" in message, message


def test_a_model_quantized_by_torchrec_is_refused_pointing_to_table_dtype():
    from torchrec.inference.modules import quantize_inference_model

    model, example = tm.build("dlrm", tm.small())
    with pytest.raises(UnsupportedModelError, match="quantize_inference_model") as err:
        cleave.partition(quantize_inference_model(model), example)
    assert "--table-dtype" in str(err.value)


def test_quantization_bench_compares_both_ways(tmp_path, capsys):
    """`cleave bench torchrec-quant`, tiny: both quantizations are measured, and int4 costs
    more than int8 both ways (it has 15 steps per row where int8 has 255)."""
    from cleave.cli import main

    out = tmp_path / "quant.json"
    argv = ["bench", "torchrec-quant", "--scale", "0.0001", "--batches", "1", "--batch", "64"]
    assert main([*argv, "--json", str(out)]) == 0
    diff = json.loads(out.read_text())["score_diff"]
    for way in ("cleave", "torchrec_fbgemm"):
        assert 0 < diff["int8"][way]["mean"] < diff["int4"][way]["mean"] < 0.01, diff
    assert "TorchRec max" in capsys.readouterr().out
