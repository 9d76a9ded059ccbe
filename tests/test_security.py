"""The client ports' security (docs/security.md), against a real `cleave serve`: a bearer token
(`--auth-token-file`) on REST and gRPC, missing or wrong: 401 / UNAUTHENTICATED, the right one
served, the token in no log line; TLS (`--tls-cert`, `--tls-key`) on both ports with a
certificate made in the test by a throwaway CA (`trustme`), the same clients over it.
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
import urllib.error
import urllib.request
from pathlib import Path

import cleave
import grpc
import pytest
import trustme
from cleave.launch.process import ServeProcess
from cleave.models import MODELS, RequestGenerator
from support.served import grpc_target
from tritonclient.grpc import service_pb2 as pb

SCALE = 0.002
TOKEN = "t0ken-that-must-not-leak-7f3a"


@pytest.fixture(scope="module")
def bundle_and_arrays(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("security")
    model, example = MODELS["dlrm"].factory(scale=SCALE, seed=0)
    bundle = cleave.partition(model.eval(), example)
    bundle_dir = bundle.save(tmp / "dlrm")
    generator = RequestGenerator("dlrm", scale=SCALE, seed=5, min_pooling=0)
    named = bundle.named_inputs(*generator.batch(3))
    return bundle_dir, {k: t.contiguous().numpy() for k, t in named.items()}, tmp


def grpc_request(arrays: dict) -> pb.ModelInferRequest:
    dtypes = {"float32": "FP32", "int64": "INT64", "int32": "INT32"}
    req = pb.ModelInferRequest(model_name="dlrm")
    for name, arr in arrays.items():
        t = req.inputs.add(name=name, datatype=dtypes[str(arr.dtype)])
        t.shape.extend(arr.shape)
        req.raw_input_contents.append(arr.tobytes())
    return req


def json_body(arrays: dict) -> bytes:
    dtypes = {"float32": "FP32", "int64": "INT64", "int32": "INT32"}
    inputs = [
        {
            "name": k,
            "shape": list(a.shape),
            "datatype": dtypes[str(a.dtype)],
            "data": a.ravel().tolist(),
        }
        for k, a in arrays.items()
    ]
    return json.dumps({"inputs": inputs}).encode()


def post(url: str, body: bytes, token: str | None, context=None) -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as resp:
            return (
                resp.status,
                {k.lower(): v for k, v in resp.headers.items()},
                json.loads(resp.read()),
            )
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, json.loads(err.read())


def infer(channel, arrays, token: str | None):
    call = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=pb.ModelInferRequest.SerializeToString,
        response_deserializer=pb.ModelInferResponse.FromString,
    )
    metadata = [("authorization", f"Bearer {token}")] if token is not None else None
    return call(grpc_request(arrays), timeout=30, metadata=metadata)


def test_bearer_tokens_on_rest_and_grpc(bundle_and_arrays):
    bundle_dir, arrays, tmp = bundle_and_arrays
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    flags = ["--shards", "1", "--rankers", "1", "--threads", "1", "--grpc-port", "0"]
    with ServeProcess(bundle_dir, *flags, "--auth-token-file", str(token_file)) as server:
        url = f"{server.url}/v2/models/dlrm/infer"
        body = json_body(arrays)
        status, headers, reply = post(url, body, None)
        assert status == 401, reply
        assert headers.get("www-authenticate") == "Bearer"
        assert reply["error"].startswith("missing bearer token"), reply
        status, _, reply = post(url, body, "wrong")
        assert (status, reply["error"]) == (
            401,
            "invalid bearer token: the token sent is not this router's",
        )
        status, _, reply = post(url, body, TOKEN)
        assert status == 200, reply
        # The probes stay open: launchers and orchestrators have no token.
        with urllib.request.urlopen(f"{server.url}/v2/health/ready", timeout=10) as resp:
            assert resp.status == 200

        with grpc.insecure_channel(grpc_target(server)) as channel:
            for token, want in ((None, "missing bearer token"), ("nope", "invalid bearer token")):
                with pytest.raises(grpc.RpcError) as caught:
                    infer(channel, arrays, token)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert caught.value.details().startswith(want), caught.value.details()
            reply = infer(channel, arrays, TOKEN)
            assert len(reply.raw_output_contents) == len(reply.outputs) >= 1
        log = "\n".join(server.log)
    assert "request refused" in log  # the refusals were logged ...
    assert TOKEN not in log  # ... without the token


def test_tls_on_rest_and_grpc(bundle_and_arrays):
    bundle_dir, arrays, tmp = bundle_and_arrays
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_file, key_file = tmp / "cert.pem", tmp / "key.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    for extra in cert.cert_chain_pems[1:]:
        extra.write_to_path(str(cert_file), append=True)
    cert.private_key_pem.write_to_path(str(key_file))
    flags = ["--shards", "1", "--rankers", "1", "--threads", "1", "--grpc-port", "0"]
    tls = ["--tls-cert", str(cert_file), "--tls-key", str(key_file)]
    # The launcher's readiness probe is plain HTTP: serve's own URL is checked below instead.
    with ServeProcess(bundle_dir, *flags, *tls) as server:
        https = server.url.replace("http://", "https://")
        context = ssl.create_default_context()
        ca.configure_trust(context)
        status, _, reply = post(f"{https}/v2/models/dlrm/infer", json_body(arrays), None, context)
        assert status == 200, reply
        # Plain HTTP to the TLS port gets no answer.
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            post(f"{server.url}/v2/models/dlrm/infer", json_body(arrays), None)
        # An untrusting client refuses the server.
        with pytest.raises(urllib.error.URLError) as caught:
            post(
                f"{https}/v2/models/dlrm/infer",
                json_body(arrays),
                None,
                ssl.create_default_context(),
            )
        assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value)

        creds = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
        with grpc.secure_channel(grpc_target(server), creds) as channel:
            reply = infer(channel, arrays, None)
            assert len(reply.raw_output_contents) == len(reply.outputs) >= 1
        with grpc.insecure_channel(grpc_target(server)) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                infer(channel, arrays, None)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def children_argv(pid: int) -> list[list[str]]:
    """The command lines of `pid`'s direct children (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out.append((entry / "cmdline").read_bytes().decode().rstrip("\0").split("\0"))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return out


def test_internal_connections_prove_the_plans_secret(bundle_and_arrays, monkeypatch):
    """With `internal_secret_env`, every role proves the secret in its HELLO: the deployment
    serves; a client that does not know it (a plain HELLO, as any process that reaches a
    shard's port could send) is refused by the shard."""
    bundle_dir, arrays, tmp = bundle_and_arrays
    monkeypatch.setenv("CLEAVE_TEST_SECRET", "internal-9d1c")
    config = tmp / "secret.toml"
    config.write_text('transport = "tcp"\n[router]\ninternal_secret_env = "CLEAVE_TEST_SECRET"\n')
    flags = ["--shards", "1", "--rankers", "1", "--threads", "1", "--config", str(config)]
    with ServeProcess(bundle_dir, *flags) as server:
        status, _, reply = post(f"{server.url}/v2/models/dlrm/infer", json_body(arrays), None)
        assert status == 200, reply
        (router_json,) = [
            argv[-1] for argv in children_argv(server.proc.pid) if "router.json" in argv[-1]
        ]
        shard_addr = json.loads(Path(router_json).read_text())["shards"][0]["addr"]
        host, port = shard_addr.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            raw.settimeout(10)
            # HELLO (kind 0) as frame.rs lays it out, with the plain 4-byte payload.
            raw.sendall(plain_hello())
            answer = b""
            while chunk := raw.recv(4096):
                answer += chunk
        assert b"unauthenticated HELLO refused" in answer, answer


def plain_hello() -> bytes:
    """A HELLO request with the plain 4-byte payload (docs/protocol.md: magic, version 2,
    flags, kind, request id, payload length, reserved, deadline, trace id)."""
    payload = bytes([0, 0, 0, 0])
    header = b"CLVW" + struct.pack("<BBHQIIQQ", 2, 0, 0, 0, len(payload), 0, 0, 0)
    return header + payload
