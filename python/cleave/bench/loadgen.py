"""HTTP and gRPC load for the KServe v2 API: open loop and one request at a time.

Open loop: send times are drawn up front (Poisson arrivals: exponential gaps at the offered
rate) and a request is sent at its time whether or not earlier ones have answered; latency is
measured from the *scheduled* time, so a client that falls behind shows up as latency, never
as a lower offered rate (no coordinated omission). `lag` says how late the client itself was.
The sending is Rust (`cleave._native.http_load`, one thread, the GIL released, gRPC too): an
aiohttp client needed most of a core at a thousand requests per second, on the cores it
measured, and Python's asyncio gRPC client more than the router it measured. Replies are parsed
after the run. One request at a time (`sequential`) and a closed loop of N clients
(`ClosedLoop`, for `cleave bench scale`) stay on aiohttp and grpcio: the Rust generator sends at
times given up front, and these send when an answer came. This is the benchmarks' one client.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import numpy as np

KSERVE_DTYPES = {
    "float32": "FP32",
    "float16": "FP16",
    "int64": "INT64",
    "int32": "INT32",
    "uint8": "UINT8",
    "bool": "BOOL",
    "bfloat16": "BF16",
}


def infer_body(named_inputs: dict, budget_ms: float | None = None) -> bytes:
    """A KServe v2 infer request body from manifest-named tensors."""
    inputs = []
    for name, tensor in named_inputs.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        inputs.append(
            {
                "name": name,
                "shape": list(tensor.shape),
                "datatype": KSERVE_DTYPES[dtype],
                "data": tensor.reshape(-1).tolist(),
            }
        )
    body: dict = {"inputs": inputs}
    if budget_ms is not None:
        body["parameters"] = {"budget_ms": budget_ms}
    return json.dumps(body).encode()


# The KServe v2 binary tensor data extension (docs/serving.md, "Binary tensors"): the header
# that says where a body's JSON ends and its tensors' raw bytes begin.
HEADER_LENGTH = "Inference-Header-Content-Length"


class BinaryBody(bytes):
    """A binary-tensor request body: JSON header, then every input's raw bytes. It is bytes
    (every sender takes it as a body) that knows the headers it must be sent with."""

    header_length: int

    def __new__(cls, header: bytes, sections: Sequence[bytes]) -> BinaryBody:
        body = super().__new__(cls, header + b"".join(sections))
        body.header_length = len(header)
        return body

    @property
    def headers(self) -> dict[str, str]:
        return {
            "Content-Type": "application/octet-stream",
            HEADER_LENGTH: str(self.header_length),
        }


def binary_infer_body(named_inputs: dict, budget_ms: float | None = None) -> BinaryBody:
    """The body of `infer_body` with every tensor binary (little-endian, row-major) and every
    output asked for binary: what tritonclient sends by default."""
    inputs, sections = [], []
    for name, tensor in named_inputs.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        raw = _raw_bytes(tensor)
        inputs.append(
            {
                "name": name,
                "shape": list(tensor.shape),
                "datatype": KSERVE_DTYPES[dtype],
                "parameters": {"binary_data_size": len(raw)},
            }
        )
        sections.append(raw)
    params: dict = {"binary_data_output": True}
    if budget_ms is not None:
        params["budget_ms"] = budget_ms
    header = json.dumps({"inputs": inputs, "parameters": params}).encode()
    return BinaryBody(header, sections)


def _raw_bytes(tensor) -> bytes:
    """A torch tensor's elements as little-endian C-order bytes (bfloat16 has no numpy dtype:
    its bits go as int16)."""
    import torch

    t = tensor.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    arr = t.numpy()
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()


def build_body(named_inputs: dict, budget_ms: float | None, protocol: str) -> bytes:
    """A request body in `protocol`: "json" (`infer_body`), "binary" (`binary_infer_body`) or
    "grpc" (`grpc_infer_message`)."""
    if protocol == "binary":
        return binary_infer_body(named_inputs, budget_ms)
    if protocol == "json":
        return infer_body(named_inputs, budget_ms)
    if protocol == "grpc":
        return grpc_infer_message(named_inputs, budget_ms)
    raise ValueError(f"protocol must be json, binary or grpc, got {protocol!r}")


_OUTPUT_DTYPES = {"FP32": "<f4", "FP16": "<f2", "INT64": "<i8", "INT32": "<i4", "UINT8": "u1"}


def parse_reply(raw: bytes) -> dict:
    """A KServe v2 infer response, JSON or binary: binary outputs get their `data` from the
    bytes after the JSON header. The header's end is where its JSON object ends (the
    Inference-Header-Content-Length response header says the same; the load generator keeps
    bodies only)."""
    text = raw.decode("latin-1")  # one char per byte: indices are byte offsets
    reply, end = json.JSONDecoder().raw_decode(text)
    if end == len(raw):
        return reply
    at = end
    for out in reply.get("outputs", []):
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is None:
            continue
        dtype = np.dtype(_OUTPUT_DTYPES[out["datatype"]])
        out["data"] = np.frombuffer(raw[at : at + size], dtype=dtype).reshape(out["shape"])
        at += size
    if at != len(raw):
        raise ValueError(f"binary reply: {len(raw) - at} bytes after the last binary output")
    return reply


def outputs_of(response: dict) -> list[np.ndarray]:
    """The output tensors of a KServe v2 infer response, in order, as float arrays."""
    return [
        np.asarray(out["data"], dtype=np.float64).reshape(out["shape"])
        for out in response["outputs"]
    ]


@dataclass
class Sample:
    index: int  # which body was sent
    scheduled_s: float  # send time from the start of the run
    lag_s: float  # how late the client sent it
    latency_s: float  # from the scheduled time to the full response
    status: int  # HTTP status; 0 when there was none
    error: str = ""  # "" for success, else a kind: "http_504", "timeout", "connection", ...
    stages_us: dict = field(default_factory=dict)  # "<stage>_us" response parameters
    max_abs_diff: float | None = None  # against the expected outputs, when checked
    router: int = 0  # which of `open_loop_spread`'s URLs it was sent to
    detail: str = ""  # the client's own words for an error without an answer ("" else)


def poisson_times(rate: float, duration_s: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    count = int(rate * duration_s * 1.2) + 16
    times = np.cumsum(rng.exponential(1.0 / rate, size=count))
    return times[times < duration_s]


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    sample: Sample,
    start: float,
    timeout: aiohttp.ClientTimeout,
    check: Callable[[int, dict], float] | None,
) -> None:
    try:
        headers = getattr(body, "headers", None) or {"Content-Type": "application/json"}
        async with session.post(url, data=body, headers=headers, timeout=timeout) as resp:
            raw = await resp.read()
            sample.status = resp.status
            done = time.perf_counter()
            if resp.status != 200:
                sample.error = f"http_{resp.status}"
            else:
                _read_reply(sample, raw, check)
    except asyncio.TimeoutError:
        done, sample.error = time.perf_counter(), "timeout"
    except aiohttp.ClientConnectionError as err:
        done, sample.error = time.perf_counter(), "connection"
        sample.detail = str(err) or type(err).__name__
    except aiohttp.ClientError as err:
        done, sample.error = time.perf_counter(), f"client_{type(err).__name__}"
    sample.latency_s = done - (start + sample.scheduled_s)


def open_loop(
    url: str,
    bodies: Sequence[bytes],
    rate: float,
    duration_s: float,
    timeout_s: float = 10.0,
    seed: int = 0,
    check: Callable[[int, dict], float] | None = None,
) -> list[Sample]:
    """Poisson arrivals at `rate` per second for `duration_s`, cycling through `bodies` in a
    seeded random order; `check(index, response_json)` returns a max abs diff to record."""
    return open_loop_phases(url, bodies, [(rate, duration_s)], timeout_s, seed, check)


def open_loop_spread(
    urls: Sequence[str],
    bodies: Sequence[bytes],
    rate: float,
    duration_s: float,
    timeout_s: float = 10.0,
    seed: int = 0,
    check: Callable[[int, dict], float] | None = None,
) -> list[Sample]:
    """`open_loop` at `rate` in total, split evenly over `urls` (a deployment's routers):
    one generator thread per URL, each its own Poisson stream (seeds differ per URL), all at
    once; every sample says which URL it went to (`Sample.router`). One URL is `open_loop`."""
    return open_loop_phases_spread(urls, bodies, [(rate, duration_s)], timeout_s, seed, check)


def open_loop_phases_spread(
    urls: Sequence[str],
    bodies: Sequence[bytes],
    phases: Sequence[tuple[float, float]],
    timeout_s: float = 10.0,
    seed: int = 0,
    check: Callable[[int, dict], float] | None = None,
    replies: bool = True,
) -> list[Sample]:
    """`open_loop_phases` with each phase's rate split evenly over `urls`, as
    `open_loop_spread` splits one rate."""
    if not urls:
        raise ValueError("open_loop_spread: expected at least one URL, got none")
    per = [(rate / len(urls), d) for rate, d in phases]
    return _spread(
        urls,
        lambda i, url: open_loop_phases(
            url, bodies, per, timeout_s, seed + 104_729 * i, check, replies
        ),
    )


def closed_loop_spread(
    urls: Sequence[str],
    bodies: Sequence[bytes],
    clients: int,
    duration_s: float,
    timeout_s: float = 10.0,
) -> list[Sample]:
    """`closed_loop` with its clients split over `urls` (at least one each), all at once."""
    if not urls:
        raise ValueError("closed_loop_spread: expected at least one URL, got none")
    each = max(1, clients // len(urls))
    return _spread(urls, lambda _, url: closed_loop(url, bodies, each, duration_s, timeout_s))


def _spread(urls: Sequence[str], run: Callable[[int, str], list[Sample]]) -> list[Sample]:
    """`run(i, url)` for every URL at once (one thread each: the generator releases the GIL;
    a failed one re-raises), the samples marked with their URL's index."""
    from concurrent.futures import ThreadPoolExecutor

    if len(urls) == 1:
        return run(0, urls[0])
    with ThreadPoolExecutor(max_workers=len(urls)) as pool:
        runs = [pool.submit(run, i, url) for i, url in enumerate(urls)]
        results = [r.result() for r in runs]
    samples = []
    for i, got in enumerate(results):
        for sample in got:
            sample.router = i
        samples.extend(got)
    return samples


def open_loop_phases(
    url: str,
    bodies: Sequence[bytes],
    phases: Sequence[tuple[float, float]],
    timeout_s: float = 10.0,
    seed: int = 0,
    check: Callable[[int, dict], float] | None = None,
    replies: bool = True,
) -> list[Sample]:
    """Poisson arrivals at each phase's (rate, seconds) in turn, in one run: the load changes
    without a pause, and a sample's scheduled time counts from the first phase's start.
    `replies=False` skips reading the 200s' bodies (no stage timings; less memory)."""
    pieces, offset = [], 0.0
    for i, (rate, duration_s) in enumerate(phases):
        pieces.append(offset + poisson_times(rate, duration_s, seed + 7919 * i))
        offset += duration_s
    times = np.concatenate(pieces) if pieces else np.zeros(0)
    order = np.random.default_rng(seed + 1).integers(0, len(bodies), size=len(times))
    return _native_load(url, bodies, times.tolist(), order.tolist(), timeout_s, replies, check)


def closed_loop(
    url: str, bodies: Sequence[bytes], clients: int, duration_s: float, timeout_s: float = 10.0
) -> list[Sample]:
    """`clients` clients for `duration_s`, each sending its next body (in a seeded random
    order) when its last one answered: how many a deployment answers when the client never
    waits on a schedule. A sample's `scheduled_s` is its send time."""
    order = np.random.default_rng(0).integers(0, len(bodies), size=max(1024, len(bodies)))
    rows = dict(clients=clients, closed_s=duration_s)
    return _native_load(url, bodies, [], order.tolist(), timeout_s, False, None, **rows)


def _native_load(url, bodies, times, order, timeout_s, replies, check, **closed) -> list[Sample]:
    """The Rust generator's run (cleave._native.http_load), as samples."""
    from cleave._native import http_load

    parse = parse_reply
    if url.startswith("grpc://"):  # one unary call per body: the messages name the model
        where, model = _grpc_target(url)
        url, parse = f"grpc://{where}{_GRPC_INFER}", parse_grpc_reply
        bodies = [grpc_with_model(b, model) for b in bodies]
    rows = http_load(
        url,
        [bytes(b) for b in bodies],
        times,
        order,
        timeout_s,
        keep_replies=replies or check is not None,
        headers=[list(getattr(b, "headers", {}).items()) for b in bodies],
        **closed,
    )
    samples = []
    for index, scheduled, lag, latency, status, error, reply in rows:
        sample = Sample(index, scheduled, lag, latency, status)
        if error == "timeout":  # the client's; a router's expired deadline is grpc_deadline_...
            sample.error = "timeout"
        elif error:
            sample.error = error if error.startswith("grpc_") else "connection"
            sample.detail = error
        elif status != 200:
            sample.error = f"http_{status}"
        elif reply is not None:
            _read_reply(sample, reply, check, parse)
        samples.append(sample)
    return samples


def _read_reply(sample: Sample, raw: bytes, check, parse=parse_reply) -> None:
    """Stage timings from a 200's parameters, and its scores checked when asked."""
    try:
        reply = parse(raw)
    except (ValueError, KeyError) as err:
        sample.error = f"client_{type(err).__name__}"
        return
    params = reply.get("parameters") or {}
    sample.stages_us = {
        k: float(v) for k, v in params.items() if k.endswith("_us") and isinstance(v, int | float)
    }
    if check is not None:
        sample.max_abs_diff = check(sample.index, reply)


_heap_frozen = False
_REFUSED_PAUSE_S = 0.2


@contextlib.contextmanager
def _no_collections():
    """A full collection of this process's heap stalled the generator for ~200 ms, which every
    request in flight then counted as latency: no collections while a run is timed. What
    exists before a run stays frozen after it (a bench's heap is mostly torch's modules), so
    only the first call pays for a full collection: unfreezing made each call's collection
    traverse the whole heap again, 0.22 s of CPU per call, a third of a quick bench's CPU."""
    global _heap_frozen
    gc.collect(1 if _heap_frozen else 2)  # gc.get_freeze_count() walks the frozen heap
    gc.freeze()
    _heap_frozen = True
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def _sequential(url, bodies, count, timeout_s, check) -> list[Sample]:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        samples = []
        for i in range(count):
            start = time.perf_counter()
            sample = Sample(i % len(bodies), 0.0, 0.0, 0.0, 0)
            await _send(session, url, bodies[sample.index], sample, start, timeout, check)
            samples.append(sample)
    return samples


def sequential(url: str, bodies: Sequence[bytes], count: int, timeout_s: float = 10.0, check=None):
    """One request at a time (the next is sent when the previous answered): single-request
    latency, with nothing else in flight."""
    run = _grpc_sequential if url.startswith("grpc://") else _sequential
    with _no_collections():
        return asyncio.run(run(url, bodies, count, timeout_s, check))


def settle(url: str, bodies: Sequence[bytes], base_ms: float, tries: int = 40) -> bool:
    """Waits out a backlog an overloading run left (requests still queued in the routers):
    lone requests, at most `tries`, until one is answered about as fast as `base_ms` (its
    unloaded latency). False when none was. A refused try waits `_REFUSED_PAUSE_S` before the
    next: a refusal answers at once, and the next try at once would be refused again."""
    for _ in range(tries):
        got = sequential(url, bodies, 1, timeout_s=30.0)
        if not got[0].error and got[0].latency_s * 1e3 <= 2 * base_ms + 1:
            return True
        if got[0].error:
            time.sleep(_REFUSED_PAUSE_S)
    return False


def codec_counters(metrics_text: str) -> dict[tuple[str, str], tuple[float, int]]:
    """The router's parse/encode CPU counters from its /metrics text:
    {(step, protocol): (cpu seconds, count)}."""
    from prometheus_client.parser import text_string_to_metric_families

    cpu: dict[tuple[str, str], float] = {}
    count: dict[tuple[str, str], int] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            key = (s.labels.get("step", ""), s.labels.get("protocol", ""))
            if s.name == "cleave_router_codec_cpu_seconds_total":
                cpu[key] = s.value
            elif s.name == "cleave_router_codec_total":
                count[key] = int(s.value)
    return {k: (cpu.get(k, 0.0), count.get(k, 0)) for k in cpu.keys() | count.keys()}


# KServe v2 gRPC (docs/serving.md, "gRPC"): a ModelInferRequest with every tensor in
# raw_input_contents (what tritonclient sends), encoded here by hand so that the load path
# needs no generated code: only grpcio's channel. Field numbers are the protocol's.
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def grpc_infer_message(named_inputs: dict, budget_ms: float | None = None) -> bytes:
    """A serialized ModelInferRequest without its model_name (`grpc_with_model` adds it)."""
    msg = bytearray()
    raws = []
    for name, tensor in named_inputs.items():
        shape = b"".join(_varint(d) for d in tensor.shape)
        datatype = KSERVE_DTYPES[str(tensor.dtype).removeprefix("torch.")].encode()
        msg += _field(5, _field(1, name.encode()) + _field(2, datatype) + _field(3, shape))
        raws.append(_raw_bytes(tensor))
    if budget_ms is not None:  # parameters["budget_ms"] = double_param
        value = _field(2, b"\x21" + struct.pack("<d", budget_ms))
        msg += _field(4, _field(1, b"budget_ms") + value)
    for raw in raws:
        msg += _field(7, raw)
    return bytes(msg)


def grpc_with_model(message: bytes, model: str) -> bytes:
    """The message with model_name set: a field appended to a protobuf message is merged."""
    return bytes(message) + _field(1, model.encode())


def _fields(buf: bytes):
    """(number, wire type, value) of each field: an int for varints, bytes for
    length-delimited and fixed-width ones."""
    at = 0
    while at < len(buf):
        key, at = _read_varint(buf, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _read_varint(buf, at)
        elif wire == 2:
            size, at = _read_varint(buf, at)
            value, at = buf[at : at + size], at + size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            value, at = buf[at : at + width], at + width
        else:
            raise ValueError(f"gRPC reply: wire type {wire} of field {number}")
        yield number, wire, value


def _read_varint(buf: bytes, at: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if at >= len(buf):
            raise ValueError("gRPC reply: truncated varint")
        b = buf[at]
        n |= (b & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not b & 0x80:
            return n, at


def parse_grpc_reply(raw: bytes) -> dict:
    """A ModelInferResponse with raw outputs, in `parse_reply`'s form."""
    outputs, raws, params = [], [], {}
    for number, _, value in _fields(raw):
        if number == 5:
            out = {"shape": []}
            for n, w, v in _fields(value):
                if n == 1:
                    out["name"] = bytes(v).decode()
                elif n == 2:
                    out["datatype"] = bytes(v).decode()
                elif n == 3 and w == 2:  # packed
                    at = 0
                    while at < len(v):
                        d, at = _read_varint(v, at)
                        out["shape"].append(d)
                elif n == 3:
                    out["shape"].append(v)
            outputs.append(out)
        elif number == 6:
            raws.append(value)
        elif number == 4:
            entry = dict((n, v) for n, _, v in _fields(value))
            choice = dict((n, v) for n, _, v in _fields(entry.get(2, b"")))
            if 2 in choice:  # int64_param
                params[bytes(entry.get(1, b"")).decode()] = choice[2]
    if len(raws) != len(outputs):
        raise ValueError(f"gRPC reply: {len(outputs)} outputs but {len(raws)} raw contents")
    for out, data in zip(outputs, raws, strict=True):
        dtype = np.dtype(_OUTPUT_DTYPES[out["datatype"]])
        out["data"] = np.frombuffer(data, dtype=dtype).reshape(out["shape"])
    return {"outputs": outputs, "parameters": params}


_GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"


def _grpc_target(url: str) -> tuple[str, str]:
    """`grpc://HOST:PORT/MODEL` -> (HOST:PORT, MODEL)."""
    where, _, model = url.removeprefix("grpc://").partition("/")
    return where, model


async def _grpc_send(call, message, sample, start, timeout_s, check) -> None:
    import grpc

    try:
        raw = await call(message, timeout=timeout_s)
        sample.status = 200
        done = time.perf_counter()
        _read_reply(sample, raw, check, parse_grpc_reply)
    except grpc.aio.AioRpcError as err:
        done = time.perf_counter()
        code = err.code()
        sample.error = "timeout" if code == grpc.StatusCode.DEADLINE_EXCEEDED else code.name
        sample.error = "grpc_" + sample.error.lower()
    sample.latency_s = done - (start + sample.scheduled_s)


def _grpc_channel(where: str):
    try:
        import grpc
    except ImportError:  # pragma: no cover - the dev extra has it
        raise RuntimeError("--protocol grpc needs grpcio (in cleave's dev extra)") from None
    limit = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    return grpc.aio.insecure_channel(where, options=limit)


async def _grpc_sequential(url, bodies, count, timeout_s, check) -> list[Sample]:
    where, model = _grpc_target(url)
    messages = [grpc_with_model(b, model) for b in bodies]
    async with _grpc_channel(where) as channel:
        call = channel.unary_unary(_GRPC_INFER)
        samples = []
        for i in range(count):
            start = time.perf_counter()
            sample = Sample(i % len(bodies), 0.0, 0.0, 0.0, 0)
            await _grpc_send(call, messages[sample.index], sample, start, timeout_s, check)
            samples.append(sample)
    return samples


# Closed loop (`cleave bench scale`): a client count, not a rate, while deployments change
# under it; the Rust generator sends at given times only, so this one stays Python.
CLOSED_LOOP_TIMEOUT_S = 30.0


@dataclass
class Answer:
    """One closed-loop request's outcome."""

    done_s: float  # monotonic time of the reply
    latency_s: float
    status: int  # 0: no HTTP answer
    error: str = ""
    max_abs_diff: float | None = None


class ClosedLoop:
    """`clients` clients, each sending its next request when its last one answered, on a
    thread of its own, from start() until stop()."""

    def __init__(self, url: str, bodies: list[bytes], clients: int, check=None):
        self.url, self.bodies, self.clients, self.check = url, bodies, clients, check
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> ClosedLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(CLOSED_LOOP_TIMEOUT_S + 10)

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=CLOSED_LOOP_TIMEOUT_S)
        connector = aiohttp.TCPConnector(limit=self.clients)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(self._client(session, i) for i in range(self.clients)))

    async def _client(self, session, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not self._stop.is_set():
            index = int(rng.integers(len(self.bodies)))
            start = time.monotonic()
            answer = Answer(0.0, 0.0, 0)
            try:
                async with session.post(
                    self.url,
                    data=self.bodies[index],
                    headers={"Content-Type": "application/json"},
                ) as resp:
                    raw = await resp.read()
                    answer.status = resp.status
                    if resp.status != 200:
                        answer.error = f"http_{resp.status}: {raw[:200].decode(errors='replace')}"
                    elif self.check is not None:
                        answer.max_abs_diff = self.check(index, parse_reply(raw))
            except asyncio.TimeoutError:
                answer.error = "timeout"
            except aiohttp.ClientError as err:
                answer.error = f"client: {type(err).__name__}"
            answer.done_s = time.monotonic()
            answer.latency_s = answer.done_s - start
            self.answers.append(answer)
