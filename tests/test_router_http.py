"""The router's HTTP API against malformed requests, on real processes over loopback: a router
(the `cleave-router` executable) in front of two embedding
shards (`cleave shard`, each holding half of every table's rows) and a ranker (`cleave
ranker`), serving the `shared` reference model (weighted sums, mean and max pooling, fixed-width
bags).

Every bad request must get a 4xx whose message names the input (or candidate) and the problem;
after the whole matrix the router still answers a good request with the model's own scores,
and it stops cleanly on SIGTERM.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from support.client import post, request
from support.router import BODY_LIMIT, Deployment, good_request
from support.served import TOLERANCE

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("router_http"))
    yield d
    d.stop()


def feature(deployment, pred):
    return next(f for f in deployment.manifest["features"] if pred(f))


def with_input(body: dict, name: str, **changes) -> dict:
    body = copy.deepcopy(body)
    entry = next(i for i in body["inputs"] if i["name"] == name)
    entry.update(changes)
    return body


def without_input(body: dict, name: str) -> dict:
    body = copy.deepcopy(body)
    body["inputs"] = [i for i in body["inputs"] if i["name"] != name]
    return body


def data_of(body: dict, name: str) -> list:
    return next(i for i in body["inputs"] if i["name"] == name)["data"]


def malformed_infer_bodies(deployment, good: dict) -> list[tuple[str, object, int, list[str]]]:
    """(case, body, status, substrings the error must contain)."""
    weighted = feature(deployment, lambda f: f["weights"])
    ids, offsets, weights = weighted["ids"], weighted["offsets"], weighted["weights"]
    rows = next(t["rows"] for t in deployment.manifest["tables"] if t["name"] == weighted["table"])
    fixed = feature(deployment, lambda f: f["layout"] == "fixed")
    n_ids = len(data_of(good, ids))
    bad_ids = list(data_of(good, ids))
    bad_ids[-1] = rows  # one past the table's last row
    return [
        ("not JSON", b'{"inputs": [', 400, ["invalid JSON"]),
        ("not an object", b"[1, 2]", 400, ["invalid JSON"]),
        ("inputs not a list", {"inputs": 7}, 400, ["invalid JSON"]),
        ("unknown field", {**good, "extra": 1}, 400, ["invalid JSON", "extra"]),
        (
            "unknown input",
            {"inputs": [*good["inputs"], {**good["inputs"][0], "name": "nope"}]},
            400,
            ['unknown input "nope"'],
        ),
        ("duplicate input", {"inputs": [*good["inputs"], good["inputs"][0]]}, 400, ["given twice"]),
        ("missing input", without_input(good, offsets), 400, [f'missing input "{offsets}"']),
        (
            "wrong datatype",
            with_input(good, "dense_x", datatype="FP64"),
            400,
            ['input "dense_x"', 'datatype "FP64", expected "FP32"'],
        ),
        (
            "wrong rank",
            with_input(good, "dense_x", shape=[len(data_of(good, "dense_x"))]),
            400,
            ['input "dense_x"', "dimensions, expected 2"],
        ),
        (
            "wrong static size",
            with_input(good, "dense_x", shape=[len(data_of(good, "dense_x")) // 4, 4]),
            400,
            ['input "dense_x"', "expected 8"],
        ),
        (
            "data does not fill the shape",
            with_input(good, ids, data=data_of(good, ids)[:-1] or [0]),
            400,
            [f'input "{ids}"', "values"],
        ),
        (
            "ragged nested data",
            with_input(good, "dense_x", data=[[0.0] * 8, [0.0] * 7]),
            400,
            ['input "dense_x"', "ragged"],
        ),
        (
            "string data",
            with_input(good, "dense_x", data=["a"] * len(data_of(good, "dense_x"))),
            400,
            ['input "dense_x"', "string"],
        ),
        (
            "non-integer ids",
            with_input(good, ids, data=[0.5] * n_ids),
            400,
            [f'input "{ids}"', "expected an int64"],
        ),
        (
            "batch sizes disagree",
            with_input(good, offsets, shape=[3], data=[0, 0, 0]),
            400,
            [f'input "{offsets}"', "but B is 4"],
        ),
        (
            "id past the table",
            with_input(good, ids, data=bad_ids),
            400,
            [f'input "{ids}"', f"id {rows} at position {n_ids - 1}", f"rows [0, {rows})"],
        ),
        (
            "negative id",
            with_input(good, ids, data=[-3] + data_of(good, ids)[1:]),
            400,
            [f'input "{ids}"', "id -3 at position 0"],
        ),
        (
            "offsets do not start at 0",
            with_input(good, offsets, data=[1, 1, 1, 1]),
            400,
            [f'input "{offsets}"', "offsets[0] is 1, expected 0"],
        ),
        (
            "offsets decrease",
            with_input(good, offsets, data=[0, min(1, n_ids), 0, 0]),
            400,
            [f'input "{offsets}"', "must not decrease"],
        ),
        (
            "offsets past the ids",
            with_input(good, offsets, data=[0, 0, 0, n_ids + 5]),
            400,
            [f'input "{offsets}"', f"outside [0, {n_ids}]"],
        ),
        (
            "weights not one per id",
            with_input(good, weights, shape=[n_ids + 1], data=[1.0] * (n_ids + 1)),
            400,
            [f'input "{weights}"'],
        ),
        (
            "fixed bags for the wrong batch",
            with_input(good, fixed["ids"], shape=[3, 2], data=[0] * 6),
            400,
            [f'input "{fixed["ids"]}"', "but B is 4"],
        ),
        (
            "negative budget",
            {**good, "parameters": {"budget_ms": -1}},
            400,
            ["budget_ms is -1"],
        ),
        ("unknown output", {**good, "outputs": [{"name": "nope"}]}, 400, ['unknown output "nope"']),
        (
            "empty outputs",
            {**good, "outputs": []},
            400,
            ['"outputs" is empty; name at least one output', 'leave "outputs" out'],
        ),
        (
            "binary_data on an input that has data",
            with_input(good, "dense_x", parameters={"binary_data": True}),
            400,
            [
                'input "dense_x"',
                'parameters.binary_data is true but the input also has "data"',
            ],
        ),
        (
            "binary_data_size on an input that has data",
            with_input(good, "dense_x", parameters={"binary_data_size": 32}),
            400,
            ['input "dense_x"', 'parameters.binary_data_size is 32 but the input also has "data"'],
        ),
        (
            "binary output flag not a bool",
            {**good, "outputs": [{"name": "output_0", "parameters": {"binary_data": "yes"}}]},
            400,
            ['output "output_0"', 'parameters.binary_data is "yes", expected true or false'],
        ),
        ("body over the limit", b" " * (BODY_LIMIT + 1), 413, [f"limit of {BODY_LIMIT} bytes"]),
    ]


def test_malformed_infer_requests_get_4xx_naming_the_input(deployment):
    good, want = good_request(deployment)
    cases = malformed_infer_bodies(deployment, good)
    for case, body, status, needles in cases:
        got, reply = post(f"{deployment.url}/infer", body)
        assert got == status, (case, reply)
        message = reply.get("error", "")
        for needle in needles:
            assert needle in message, (case, needle, message)

    # The router is unharmed: the good request gets the model's scores.
    status, reply = post(f"{deployment.url}/infer", good)
    assert status == 200, reply
    for out, w in zip(reply["outputs"], want, strict=True):
        got = torch.tensor(out["data"], dtype=torch.float64).reshape(out["shape"])
        assert got.shape == w.shape
        assert (got - w).abs().max().item() <= TOLERANCE

    # tritonclient's JSON mode marks every tensor binary_data: false; that is JSON data.
    json_mode = copy.deepcopy(good)
    for entry in json_mode["inputs"]:
        entry["parameters"] = {"binary_data": False}
    json_mode["outputs"] = [{"name": "output_0", "parameters": {"binary_data": False}}]
    json_mode["parameters"] = {"binary_data_output": False}
    status, reply = post(f"{deployment.url}/infer", json_mode)
    assert status == 200, reply
    assert [o["name"] for o in reply["outputs"]] == ["output_0"]

    status, metrics = request(f"{deployment.router.address}/metrics")
    assert status == 200
    invalid = sum(1 for _, _, s, n in cases if s == 400 and "invalid JSON" not in n)
    assert f'cleave_router_errors_total{{kind="invalid_input"}} {invalid}' in metrics
    assert 'cleave_router_errors_total{kind="too_large"} 1' in metrics


def rank_body(deployment, good: dict) -> dict:
    """The per-feature form of the first two candidates of `good`."""
    manifest = deployment.manifest
    jagged = {f["ids"]: f for f in manifest["features"] if f["layout"] == "offsets"}
    offsets = {f["offsets"] for f in jagged.values()}
    tensors = {i["name"]: torch.tensor(i["data"]).reshape(i["shape"]) for i in good["inputs"]}
    candidates = []
    for c in range(2):
        cand = {}
        for spec in manifest["inputs"]:
            name = spec["name"]
            if name in offsets:
                continue
            f = jagged.get(name) or next((f for f in jagged.values() if f["weights"] == name), None)
            if f is not None:
                o = tensors[f["offsets"]].tolist()
                end = o[c + 1] if c + 1 < len(o) else len(tensors[f["ids"]])
                cand[name] = tensors[name][o[c] : end].tolist()
            else:
                cand[name] = tensors[name][c].tolist()
        candidates.append(cand)
    return {"candidates": candidates}


def test_malformed_rank_requests_get_4xx_naming_the_candidate(deployment):
    good, _ = good_request(deployment)
    body = rank_body(deployment, good)
    status, reply = post(f"{deployment.url}/rank", body)
    assert status == 200, reply
    assert len(reply["outputs"]["output_0"]) == 2

    weighted = feature(deployment, lambda f: f["weights"])
    ids, offsets, weights = weighted["ids"], weighted["offsets"], weighted["weights"]
    cases = []
    b = copy.deepcopy(body)
    del b["candidates"][1]["dense_x"]
    cases.append((b, ['candidate 1: input "dense_x": missing']))
    b = copy.deepcopy(body)
    b["candidates"][0][offsets] = [0]
    cases.append((b, [f'candidate 0: input "{offsets}"', f'under "{ids}"']))
    b = copy.deepcopy(body)
    b["candidates"][1]["dense_x"] = [0.0] * 7
    cases.append((b, ['candidate 1: input "dense_x": row has shape [7]']))
    b = copy.deepcopy(body)
    b["candidates"][0][weights] = b["candidates"][0][weights] + [1.0]
    cases.append((b, [f'candidate 0: input "{weights}"', "one weight per id"]))
    b = copy.deepcopy(body)
    b["candidates"][1][ids] = 5
    cases.append((b, [f'candidate 1: input "{ids}": must be a list of ids']))
    b = copy.deepcopy(body)
    b["shared"] = {"dense_x": [0.0] * 8}
    cases.append((b, ['input "dense_x": has one value per candidate']))
    cases.append(({"candidates": []}, ['"candidates" is empty']))
    for body_, needles in cases:
        status, reply = post(f"{deployment.url}/rank", body_)
        assert status == 400, (needles, reply)
        for needle in needles:
            assert needle in reply["error"], (needle, reply)
    # Still serving.
    assert post(f"{deployment.url}/rank", body)[0] == 200


def test_metadata_health_and_unknown_models(deployment):
    status, text = request(deployment.url)
    assert status == 200
    meta = json.loads(text)
    assert [i["name"] for i in meta["inputs"]] == [i["name"] for i in deployment.manifest["inputs"]]
    assert meta["inputs"][0] == {"name": "dense_x", "datatype": "FP32", "shape": [-1, 8]}
    assert request(f"{deployment.router.address}/v2/health/live")[0] == 200
    assert request(f"{deployment.router.address}/v2/health/ready")[0] == 200
    assert request(f"{deployment.url}/ready")[0] == 200
    status, reply = post(f"{deployment.router.address}/v2/models/nope/infer", {"inputs": []})
    assert status == 404
    assert 'unknown model "nope"' in reply["error"]


def test_router_stops_cleanly_on_sigterm(deployment):
    # Last in this module: stops the router (the fixture then stops the rest).
    assert deployment.router.stop() == 0
