"""`cleave shard` processes on loopback, checked against torch.nn.functional.embedding_bag.

Bundles are written here with numpy (docs/bundle.md: manifest.json + tables/*.bin), so these
tests depend only on the shard. Every bad-input case talks to a shard over a raw socket (or
the client) and is followed by a good request that must still succeed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cleave import _native
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.shards import (
    BAD_REQUEST,
    DEADLINE,
    DIMS,
    DTYPES,
    HANDSHAKE,
    HEADER,
    LOOKUP,
    MALFORMED,
    NOT_FOUND,
    OUT_OF_RANGE,
    ROWS,
    TIMEOUT,
    TOO_LARGE,
    UNKNOWN_KIND,
    UNSUPPORTED_VERSION,
    Shard,
    Tables,
    assert_closed,
    connect,
    error_of,
    frame,
    read_frame,
    routes_for,
    split_ranges,
    start,
    write_bundle,
)
from support.waiting import wait_for

# ---------------------------------------------------------------------------------------------
# Reference


def reference(values: dict, table: str, pooling: str, ids, offsets, weights=None):
    w = torch.from_numpy(values[table])
    ids_t = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    if pooling == "none":
        return F.embedding(ids_t, w).numpy()
    offs = torch.as_tensor(np.asarray(offsets[:-1], dtype=np.int64))
    psw = None if weights is None else torch.as_tensor(np.asarray(weights, dtype=np.float32))
    out = F.embedding_bag(ids_t, w, offs, mode=pooling, per_sample_weights=psw)
    return out.numpy()


def magnitude(values: Tables, table: str, pooling: str, ids, offsets, weights=None):
    """Per output element, the same pooling of |terms|: the scale rounding errors grow with."""
    w = None if weights is None else np.abs(np.asarray(weights, dtype=np.float32))
    return reference({table: values.terms[table]}, table, pooling, ids, offsets, w) + 1e-30


def check(values, client, requests) -> None:
    got = client.lookup(requests)
    assert len(got) == len(requests)
    for (table, pooling, ids, offsets, *weights), out in zip(requests, got, strict=True):
        w = weights[0] if weights else None
        ref = reference(values, table, pooling, ids, offsets, w)
        assert out.dtype == np.float32 and out.shape == ref.shape, (out.shape, ref.shape)
        if pooling in ("max", "none") and DTYPES[table] != "int8_rowwise":
            np.testing.assert_array_equal(out, ref, err_msg=f"{table} {pooling}")  # copies
        else:
            diff = np.abs(out - ref)
            bound = 1e-6 * magnitude(values, table, pooling, ids, offsets, w)
            assert (diff <= bound).all(), f"{table} {pooling}: max diff {diff.max()}"


def bags(rng, rows: int, n_bags: int, max_len: int):
    lengths = rng.integers(0, max_len + 1, size=n_bags)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return rng.integers(0, rows, size=int(offsets[-1])).astype(np.int64), offsets


# ---------------------------------------------------------------------------------------------
# Fixtures: one bundle; deployments of 1, 2 and 5 shards, started together


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("shard-bundle") / "bundle"
    return root, write_bundle(root)


@pytest.fixture(scope="module")
def deployments(bundle):
    root, _ = bundle
    specs = (
        [()] + [("--rows", r) for r in split_ranges(2)] + [("--rows", r) for r in split_ranges(5)]
    )
    shards = start(root, specs)
    groups = {1: shards[:1], 2: shards[1:3], 5: shards[3:]}
    clients = {n: _native.ShardClient(routes_for(g, n), timeout_s=10) for n, g in groups.items()}
    yield groups, clients
    for s in shards:
        assert s.stop() == 0


# ---------------------------------------------------------------------------------------------
# Results


@pytest.mark.parametrize("n_shards", [1, 2, 5])
@pytest.mark.parametrize("pooling", ["sum", "mean", "max", "none"])
def test_every_dtype_and_pooling_matches_torch(bundle, deployments, n_shards, pooling):
    _, values = bundle
    _, clients = deployments
    rng = np.random.default_rng(n_shards * 10 + len(pooling))
    requests = []
    for table, rows in ROWS.items():
        ids, offsets = bags(rng, rows, n_bags=24, max_len=30)
        requests.append((table, pooling, ids, None if pooling == "none" else offsets))
    check(values, clients[n_shards], requests)


@pytest.mark.parametrize("n_shards", [1, 2, 5])
def test_empty_bags_repeated_ids_boundaries_and_weights(bundle, deployments, n_shards):
    _, values = bundle
    _, clients = deployments
    rows = ROWS["f32"]
    # Every range boundary of every deployment, on both sides, repeated.
    edges = sorted({rows * i // k + d for k in (2, 5) for i in range(k + 1) for d in (-1, 0)})
    edges = [e for e in edges if 0 <= e < rows]
    ids = np.array(edges + edges[::-1] + [7, 7, 7, 7], dtype=np.int64)
    offsets = np.array([0, 0, len(edges), len(edges), 2 * len(edges), len(ids), len(ids)])
    weights = np.linspace(-2, 2, len(ids)).astype(np.float32)
    requests = [("f32", p, ids, offsets) for p in ("sum", "mean", "max")]
    requests += [("f32", "sum", ids, offsets, weights), ("f32", "none", ids, None)]
    requests += [("f32", p, np.array([], np.int64), np.array([0, 0, 0])) for p in ("sum", "max")]
    requests += [("i8", "mean", np.array([0, 256, 0]), np.array([0, 3]))]
    check(values, clients[n_shards], requests)
    empty = clients[n_shards].lookup([("f32", "max", np.array([], np.int64), np.array([0, 0]))])
    np.testing.assert_array_equal(empty[0], np.zeros((1, DIMS["f32"]), np.float32))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.data(),
    table=st.sampled_from(sorted(ROWS)),
    pooling=st.sampled_from(["sum", "mean", "max", "none"]),
    n_shards=st.sampled_from([1, 2, 5]),
)
def test_random_batches_match_torch(bundle, deployments, data, table, pooling, n_shards):
    _, values = bundle
    _, clients = deployments
    lengths = data.draw(st.lists(st.integers(0, 12), min_size=0, max_size=8), label="bag sizes")
    ids = data.draw(
        st.lists(st.integers(0, ROWS[table] - 1), min_size=sum(lengths), max_size=sum(lengths)),
        label="ids",
    )
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.array(ids, dtype=np.int64)
    if pooling == "none":
        request = (table, pooling, ids, None)
    elif pooling == "sum" and data.draw(st.booleans(), label="weighted"):
        w = data.draw(st.lists(st.floats(-4, 4, width=32), min_size=len(ids), max_size=len(ids)))
        request = (table, pooling, ids, offsets, np.array(w, dtype=np.float32))
    else:
        request = (table, pooling, ids, offsets)
    if pooling != "none" and len(lengths) == 0:
        return  # embedding_bag needs at least one bag
    check(values, clients[n_shards], [request])


def test_metrics_ready_live_and_counters(deployments):
    groups, clients = deployments
    shard = groups[1][0]
    before = shard.metric("cleave_shard_rows_total")
    clients[1].lookup([("f32", "sum", np.arange(10), np.array([0, 4, 10]))])
    assert shard.metric("cleave_shard_rows_total") == before + 10
    status, body = shard.get("/ready")
    assert status == 200, body
    assert json.loads(body) == {
        "role": "shard",
        "status": "ready",
        "ready": True,
        "degraded": [],
        "problems": [],
    }
    assert shard.get("/live") == (200, "live\n")
    _, text = shard.get("/metrics")
    assert "# TYPE cleave_shard_request_duration_seconds histogram" in text
    assert 'cleave_shard_table_rows{table="f32",row_start="0",row_end="1000"} 1000' in text


# ---------------------------------------------------------------------------------------------
# Bad input: each case, then a good request on the same shard


@pytest.fixture(scope="module")
def lone(bundle):
    root, values = bundle
    (shard,) = start(root, [("--frame-timeout", "0.5")])
    yield shard, values
    assert shard.stop() == 0


def good_request(shard: Shard, values) -> None:
    client = _native.ShardClient([(t, 0, r, shard.address) for t, r in ROWS.items()], timeout_s=10)
    check(values, client, [("f16", "sum", np.array([1, 2, 299]), np.array([0, 1, 3]))])


def lookup_frame(requests, rid: int = 1) -> bytes:
    return frame(LOOKUP, rid, _native.encode_lookups(requests))


def test_bad_lookups_get_error_frames_and_the_connection_stays(lone):
    shard, values = lone
    s = connect(shard.address)
    one = (np.array([1]), np.array([0, 1]))
    cases = [
        ([("nope", "sum", *one)], NOT_FOUND, 'table "nope" is not held'),
        ([("f32", "sum", np.array([1000]), one[1])], OUT_OF_RANGE, "id 1000"),
        ([("f32", "max", np.array([-3]), one[1])], OUT_OF_RANGE, "id -3"),
    ]
    for rid, (requests, code, says) in enumerate(cases):
        s.sendall(lookup_frame(requests, rid))
        f = read_frame(s)
        assert f[2] == rid
        got_code, message = error_of(f)
        assert (got_code, says in message) == (code, True), message
    payload = bytearray(_native.encode_lookups([("f32", "sum", *one)]))
    bad_dtype = bytes(payload[:9]) + bytes([7]) + bytes(payload[10:])
    truncated = bytes(payload[:-4])
    for rid, (body, says) in enumerate(
        [
            (bad_dtype, "id dtype 7 unknown"),
            (truncated, "truncated"),
            (b"\x01", "truncated"),
            (bytes(payload[:8]) + b"\x00" * 3, "announces 1 lookups but its 11 bytes"),
        ],
        start=10,
    ):
        s.sendall(frame(LOOKUP, rid, body))
        code, message = error_of(read_frame(s))
        assert code == BAD_REQUEST and says in message, message
    s.sendall(frame(0x0200, 99, b""))
    assert error_of(read_frame(s))[0] == UNKNOWN_KIND
    s.sendall(lookup_frame([("f32", "none", np.array([5]), None)], 100))
    flags, _, rid, body = read_frame(s)
    assert (flags, rid) == (1, 100)
    got = np.frombuffer(body[8 + 16 :], dtype=np.float32)
    np.testing.assert_array_equal(got, values["f32"][5])
    # A lookup whose deadline (header, Unix µs) has passed is answered `deadline`, not looked up.
    late = _native.encode_lookups([("f32", "none", np.array([5]), None)])
    s.sendall(frame(LOOKUP, 101, late, deadline_us=1))
    code, message = error_of(read_frame(s))
    assert code == DEADLINE and "deadline passed" in message, message
    good_request(shard, values)


@pytest.mark.parametrize(
    "what",
    ["bad magic", "version", "reserved", "oversized", "no hello", "silent", "mid-frame timeout"],
)
def test_malformed_frames_close_the_connection_and_others_are_served(lone, what):
    shard, values = lone
    other = connect(shard.address)  # a second client, busy throughout
    s = connect(shard.address, hello=what not in ("no hello", "silent"))
    good = lookup_frame([("f32", "sum", np.array([3]), np.array([0, 1]))], 5)
    expected = {
        "bad magic": (b"GET /metrics HTTP/1.1\r\n\r\n" + b" " * 8, MALFORMED),
        "version": (good[:4] + b"\x01" + good[5:], UNSUPPORTED_VERSION),
        "reserved": (good[:20] + b"\x01" + good[21:], MALFORMED),
        "oversized": (HEADER.pack(b"CLVW", 2, 0, LOOKUP, 5, 1 << 31, 0, 0, 0), TOO_LARGE),
        "no hello": (good, HANDSHAKE),
        "silent": (b"", TIMEOUT),
        "mid-frame timeout": (good[:30], TIMEOUT),
    }
    data, code = expected[what]
    s.sendall(data)
    other.sendall(good)
    assert read_frame(other)[0] == 1  # served while the bad one waits for its timeout
    got, message = error_of(read_frame(s))
    assert got == code, message
    assert_closed(s)
    other.sendall(good)
    assert read_frame(other)[0] == 1
    good_request(shard, values)


def test_disconnect_mid_frame_and_wrong_client_types(lone):
    shard, values = lone
    for cut in (1, 24, 40):
        s = connect(shard.address)
        s.sendall(lookup_frame([("f32", "sum", np.arange(8), np.array([0, 8]))])[:cut])
        s.close()
    good_request(shard, values)
    client = _native.ShardClient([("f32", 0, 1000, shard.address)])
    with pytest.raises(TypeError, match="ids must be a 1-D integer numpy array, got an array of"):
        client.lookup([("f32", "sum", np.array([1.5]), np.array([0, 1]))])
    with pytest.raises(ValueError, match="last offset is 2, expected the number of ids 1"):
        client.lookup([("f32", "sum", np.array([1]), np.array([0, 2]))])
    with pytest.raises(ValueError, match="pooling must be sum, mean, max or none"):
        client.lookup([("f32", "median", np.array([1]), np.array([0, 1]))])
    with pytest.raises(ValueError, match="outside every route"):
        client.lookup([("f32", "sum", np.array([1000]), np.array([0, 1]))])
    # Routes that promise rows the shard lacks: the shard's own range check answers.
    wrong = _native.ShardClient([("f32", 0, 5000, shard.address)])
    with pytest.raises(_native.ShardError, match=f"shard {shard.address}: error 9 .*id 4000"):
        wrong.lookup([("f32", "sum", np.array([4000]), np.array([0, 1]))])
    good_request(shard, values)


# ---------------------------------------------------------------------------------------------
# Failures and shutdown


def test_killed_shard_is_named_in_the_error(bundle):
    root, values = bundle
    a, b = start(root, [("--rows", r) for r in split_ranges(2)])
    client = _native.ShardClient(routes_for([a, b], 2), timeout_s=30)
    request = [("f32", "sum", np.array([1, 999]), np.array([0, 2]))]
    check(values, client, request)
    b.proc.kill()
    b.proc.wait(timeout=10)
    # Refused at once: a connect error, not the 30 s timeout.
    with pytest.raises(_native.ShardError, match=f"shard {b.address}: .*(connect|closed)"):
        client.lookup(request)
    check(values, client, [("f32", "sum", np.array([1, 2]), np.array([0, 2]))])  # a only
    assert a.stop() == 0


def test_sigterm_finishes_the_request_in_flight_and_exits_zero(bundle):
    root, values = bundle
    (shard,) = start(root, [()])
    s = connect(shard.address)
    ids = np.arange(0, 1000, 3)
    data = lookup_frame([("f32", "sum", ids, np.array([0, len(ids)]))], 42)
    s.sendall(data[: len(data) // 2])
    wait_for(
        lambda: shard.metric("cleave_shard_frames_receiving") == 1,
        "the shard to see the partial frame",
        10,
    )
    shard.proc.send_signal(signal.SIGTERM)
    # Draining: no longer ready, still serving.
    wait_for(lambda: shard.get("/ready")[0] == 503, "the shard to turn unready on SIGTERM", 10)
    s.sendall(data[len(data) // 2 :])
    flags, _, rid, body = read_frame(s)
    assert (flags, rid) == (1, 42)
    got = np.frombuffer(body[8 + 16 + 8 :], dtype=np.float32)
    np.testing.assert_allclose(got, values["f32"][ids].sum(axis=0), rtol=1e-5, atol=1e-4)
    assert_closed(s)
    assert shard.proc.wait(timeout=20) == 0


def test_unix_socket_and_table_subsets(bundle, tmp_path):
    root, values = bundle
    path = tmp_path / "shard.sock"
    shard = Shard(root, "--tables", "f16,i8", "--rows", "10:200", listen=f"unix:{path}")
    shard.wait_ready()
    assert shard.address == f"unix:{path}"
    client = _native.ShardClient(
        [("f16", 10, 200, shard.address), ("i8", 10, 200, shard.address)], timeout_s=10
    )
    check(values, client, [("f16", "mean", np.array([10, 199]), np.array([0, 2]))])
    with pytest.raises(_native.ShardError, match="not held"):
        _native.ShardClient([("f32", 0, 10, shard.address)]).lookup(
            [("f32", "sum", np.array([1]), np.array([0, 1]))]
        )
    assert shard.stop(signal.SIGINT) == 0  # Ctrl-C stops as cleanly as SIGTERM
    assert not path.exists()


@pytest.mark.parametrize(
    "flags, says",
    [
        (("--bundle", "/nonexistent/bundle"), "manifest.json"),
        (("--tables", "f32,zzz"), '"zzz" is not in'),
        (("--rows", "5:1"), "START 5 is after END 1"),
        (("--rows", "f32=1:2", "--tables", "f16"), "not among --tables"),
        (
            ("--listen", "nowhere"),
            "expected host:port, mptcp:host:port, unix:/path or shm:/path",
        ),
        (("--threads", "0"), "at least 1"),
    ],
)
def test_bad_command_lines_exit_2_with_a_message(bundle, flags, says):
    root, _ = bundle
    argv = [sys.executable, "-m", "cleave.cli", "shard", "--bundle", str(root)]
    argv += ["--listen", "127.0.0.1:0", *flags]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r
    assert says in r.stderr, r.stderr
    assert r.stdout == ""


def test_shard_command_does_not_import_torch(bundle):
    root, _ = bundle
    code = (
        "import sys, cleave.cli, cleave.launch.shard\n"
        "cleave.cli.build_parser(['shard'])\n"
        "print('torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == "False", r
    assert os.environ.get("CLEAVE_NO_SUCH_VAR") is None
