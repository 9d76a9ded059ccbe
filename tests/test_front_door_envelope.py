"""REST and gRPC agree at the router's front door, because both go through one envelope
(crates/cleave-router/src/envelope.rs; docs/api.md, "Admission control and load shedding"):

* a request's budget starts at its first byte on both doors: a body (REST) or message (gRPC)
  whose last part the client sends only after the budget ran out gets 504 / DEADLINE_EXCEEDED
  at stage "parse", and the same request sent at once is answered;
* a shed request carries a retry hint on both: `Retry-After` on the 503 (through curl), and
  UNAVAILABLE with a `google.rpc.RetryInfo` in `grpc-status-details-bin` plus `retry-after`
  metadata (through tritonclient's gRPC client, and grpcio for the trailers it hides).

One router process of its own per test, on the shards and ranker of test_router_http's
`Deployment`. Shedding is forced with `max_in_flight = 1` and one REST request held in flight.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
import urllib.parse

import grpc
import h2.connection
import h2.events
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from google.rpc import error_details_pb2, status_pb2
from support import front_door
from support.front_door import BOUND_S, Router, post_head, read_response
from support.router import MODEL, good_request
from support.waiting import wait_for
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

BUDGET_MS = 200
# How late the client sends the last part on purpose: well past the budget, and well within
# the second the router drains a connection it closes.
LATE_S = 0.5
INFER = "/inference.GRPCInferenceService/ModelInfer"
NUMPY = {"FP32": np.float32, "INT64": np.int64, "INT32": np.int32}


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    d = front_door.backends(tmp_path_factory.mktemp("front_door_envelope"))
    yield d
    d.stop()


def arrays(body: dict) -> dict[str, np.ndarray]:
    """The inputs of a KServe JSON body as numpy arrays."""
    return {
        i["name"]: np.asarray(i["data"], dtype=NUMPY[i["datatype"]]).reshape(i["shape"])
        for i in body["inputs"]
    }


def grpc_request(body: dict) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=MODEL)
    for i, (name, arr) in zip(body["inputs"], arrays(body).items(), strict=True):
        tensor = req.inputs.add(name=name, datatype=i["datatype"])
        tensor.shape.extend(arr.shape)
        req.raw_input_contents.append(arr.tobytes())
    return req


def infer_call(channel: grpc.Channel):
    return channel.unary_unary(
        INFER,
        request_serializer=pb.ModelInferRequest.SerializeToString,
        response_deserializer=pb.ModelInferResponse.FromString,
    )


def grpc_in_two_parts(target: str, message: bytes, metadata: dict[str, str]) -> dict[str, str]:
    """One ModelInfer call over a plain HTTP/2 connection: its head and the first bytes of
    its message at once, the rest `LATE_S` later; returns the response's headers and
    trailers."""
    conn = h2.connection.H2Connection()
    conn.initiate_connection()
    host, port = target.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=BOUND_S)
    with sock:
        sock.sendall(conn.data_to_send())
        stream = conn.get_next_available_stream_id()
        head = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", INFER),
            (":authority", target),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *metadata.items(),
        ]
        conn.send_headers(stream, head)
        framed = b"\0" + len(message).to_bytes(4, "big") + message
        conn.send_data(stream, framed[:10])
        sock.sendall(conn.data_to_send())
        time.sleep(LATE_S)  # the client is late on purpose
        rest = framed[10:]
        step = conn.max_outbound_frame_size
        for at in range(0, len(rest), step):
            conn.send_data(stream, rest[at : at + step], end_stream=at + step >= len(rest))
        sock.sendall(conn.data_to_send())
        answer: dict[str, str] = {}
        while True:
            data = sock.recv(65536)
            assert data, f"connection closed before the call ended; so far {answer}"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    answer.update((k.decode(), v.decode()) for k, v in event.headers)
                if isinstance(event, h2.events.StreamReset):
                    raise AssertionError(f"stream reset: {event}")
                if isinstance(event, h2.events.StreamEnded):
                    return answer
            sock.sendall(conn.data_to_send())


def test_the_budget_starts_at_the_first_byte_on_both_doors(backends):
    good, _ = good_request(backends)
    raw = json.dumps(good).encode()
    with Router(backends, body_grace_ms=30000, grpc_port=0) as router:
        target = router.grpc_address
        # REST: the head and 10 bytes of the body, the rest after the budget.
        sock = router.connect()
        extra = f"cleave-budget-ms: {BUDGET_MS}\r\n"
        sock.sendall(post_head(f"/v2/models/{MODEL}/infer", len(raw), extra) + raw[:10])
        time.sleep(LATE_S)  # the client is late on purpose
        with contextlib.suppress(OSError):  # the router may have closed by now
            sock.sendall(raw[10:])
        status, headers, body = read_response(sock)
        sock.close()
        assert status == 504, body
        reply = json.loads(body)
        assert reply["stage"] == "parse", reply
        assert f"latency budget of {BUDGET_MS} ms ran out" in reply["error"], reply

        # gRPC: the call's head and 10 bytes of its message, the rest after the budget.
        message = grpc_request(good).SerializeToString()
        answer = grpc_in_two_parts(target, message, {"cleave-budget-ms": str(BUDGET_MS)})
        assert answer.get("grpc-status") == str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0]), answer
        assert answer.get("cleave-stage") == "parse", answer
        assert f"latency budget of {BUDGET_MS} ms ran out" in urllib.parse.unquote(
            answer.get("grpc-message", "")
        ), answer
        assert len(answer.get("x-request-id", "")) == 16, answer
        assert router.metric('cleave_router_errors_total{kind="deadline"}') == 2

        # The same requests sent at once are answered.
        with grpc.insecure_channel(target) as channel:
            md = (("cleave-budget-ms", "5000"),)
            reply = infer_call(channel)(grpc_request(good), metadata=md, timeout=BOUND_S)
        assert len(reply.raw_output_contents) == len(reply.outputs) >= 1
        sock = router.connect()
        sock.sendall(post_head(f"/v2/models/{MODEL}/infer", len(raw)) + raw)
        status, _, body = read_response(sock)
        sock.close()
        assert status == 200, body


def test_a_shed_request_gets_a_retry_hint_on_both_doors(backends, tmp_path):
    good, _ = good_request(backends)
    raw = json.dumps(good).encode()
    body_file = tmp_path / "body.json"
    body_file.write_bytes(raw)
    with Router(backends, max_in_flight=1, body_grace_ms=30000, grpc_port=0) as router:
        target = router.grpc_address
        holder = router.connect()
        holder.sendall(post_head(f"/v2/models/{MODEL}/infer", len(raw)) + raw[:10])
        wait_for(lambda: router.metric("cleave_router_in_flight") == 1, "one request in flight")

        # REST through curl: 503 with Retry-After.
        curl = subprocess.run(
            ["curl", "-sS", "-D", "-", "-o", str(tmp_path / "reply.json")]
            + ["-H", "Content-Type: application/json", "--data-binary", f"@{body_file}"]
            + [f"{router.url}/infer"],
            capture_output=True,
            text=True,
            timeout=BOUND_S,
            check=True,
        )
        lines = curl.stdout.splitlines()
        assert lines[0].split()[1] == "503", curl.stdout
        headers = {k.lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if x)}
        assert int(headers["retry-after"]) >= 1, headers
        assert json.loads((tmp_path / "reply.json").read_text())["stage"] == "admission"

        # gRPC through tritonclient: UNAVAILABLE, the code clients retry.
        client = grpcclient.InferenceServerClient(target)
        inputs = []
        for i, (name, arr) in zip(good["inputs"], arrays(good).items(), strict=True):
            inp = grpcclient.InferInput(name, list(arr.shape), i["datatype"])
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        with pytest.raises(InferenceServerException) as caught:
            client.infer(MODEL, inputs, client_timeout=BOUND_S)
        client.close()
        assert caught.value.status() == "StatusCode.UNAVAILABLE", caught.value
        assert "(max_in_flight) is 1" in caught.value.message()

        # The trailers tritonclient does not show, through grpcio: RetryInfo and retry-after.
        with grpc.insecure_channel(target) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                infer_call(channel)(grpc_request(good), timeout=BOUND_S)
        error = caught.value
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        trailers = dict(error.trailing_metadata())
        assert int(trailers["retry-after"]) >= 1, trailers
        assert trailers["cleave-stage"] == "admission", trailers
        status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
        assert status.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert status.message == error.details()
        retry = error_details_pb2.RetryInfo()
        assert [d.Unpack(retry) for d in status.details] == [True], status
        assert retry.retry_delay.seconds == int(trailers["retry-after"])

        # The request in flight finishes when its body does; three were shed.
        holder.sendall(raw[10:])
        status_code, _, body = read_response(holder)
        holder.close()
        assert status_code == 200, body
        assert router.metric('cleave_router_shed_total{reason="in_flight"}') == 3
        assert router.metric('cleave_router_errors_total{kind="overloaded"}') == 3
