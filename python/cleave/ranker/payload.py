"""RANK / RANK_FULL payloads (docs/protocol.md, "Ranker messages"): raw little-endian tensors
read straight into torch tensors that share the payload's memory (no JSON, no per-element copy).

```
request  := n_tensors:u32  max_batch:u32 (the router's cap; 0: none)  tensor[n_tensors]
response := queue_us:u32 compute_us:u32 batch_requests:u32 queue_depth:u32 n_tensors:u32
            reserved:u32  tensor[n_tensors]
tensor   := dtype:u8 ndim:u8 reserved:u16 reserved:u32 dims:u64[ndim] data pad(to 8 bytes)
```

The request's deadline and trace id travel in the frame header (protocol version 2); the
batcher gets them from `FrameServer.recv`.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass

import torch

# Frame kinds of the ranker messages: application kinds 0x0110..0x011f belong to rankers.
KIND_RANK = 0x0110
KIND_RANK_FULL = 0x0111

DTYPES: dict[int, torch.dtype] = {
    0: torch.float32,
    1: torch.float16,
    2: torch.int64,
    3: torch.int32,
    4: torch.uint8,
    5: torch.bool,
    6: torch.bfloat16,
}
DTYPE_CODES: dict[torch.dtype, int] = {dtype: code for code, dtype in DTYPES.items()}
# Manifest dtype names (docs/bundle.md) -> torch dtypes.
DTYPE_NAMES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in DTYPES.values()}

_REQUEST_HEAD = struct.Struct("<II")
_RESPONSE_HEAD = struct.Struct("<IIIIII")
_TENSOR_HEAD = struct.Struct("<BBHI")
_U32_MAX = 2**32 - 1
MAX_NDIM = 16

# torch.frombuffer warns on read-only buffers (the frames' payloads); the tensors are only read.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class PayloadError(ValueError):
    """A payload that does not follow the layout above: says what was expected and where."""


@dataclass
class RankRequest:
    tensors: list[torch.Tensor]
    # The largest batch (rows) the router's memory budget allows now (docs/cache.md); 0: none.
    max_batch: int = 0


@dataclass
class RankResponse:
    queue_us: int
    compute_us: int
    batch_requests: int
    queue_depth: int
    tensors: list[torch.Tensor]


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _read_tensors(
    buf: memoryview, offset: int, count: int, what: str
) -> tuple[list[torch.Tensor], int]:
    tensors = []
    size = len(buf)
    for i in range(count):
        where = f"{what} tensor {i} at byte {offset}"
        if offset + _TENSOR_HEAD.size > size:
            raise PayloadError(f"{where}: header needs 8 bytes, payload ends at byte {size}")
        code, ndim, _, _ = _TENSOR_HEAD.unpack_from(buf, offset)
        dtype = DTYPES.get(code)
        if dtype is None:
            raise PayloadError(f"{where}: dtype code {code} is not one of 0..6")
        if ndim > MAX_NDIM:
            raise PayloadError(f"{where}: {ndim} dims, at most {MAX_NDIM} are allowed")
        offset += _TENSOR_HEAD.size
        if offset + 8 * ndim > size:
            raise PayloadError(f"{where}: {ndim} dims need {8 * ndim} bytes, payload ends")
        dims = struct.unpack_from(f"<{ndim}Q", buf, offset)
        if any(d >= 1 << 63 for d in dims):  # torch shapes are int64; a 0 dim hides it from numel
            raise PayloadError(f"{where}: shape {list(dims)} has a dim past 2^63 - 1")
        offset += 8 * ndim
        numel = 1
        for d in dims:
            numel *= d
        nbytes = numel * dtype.itemsize
        if offset + nbytes > size:
            raise PayloadError(
                f"{where}: shape {list(dims)} of {dtype} needs {nbytes} data bytes, "
                f"only {size - offset} left"
            )
        if numel == 0:
            tensor = torch.empty(dims, dtype=dtype)
        else:
            # Shares the payload's memory: the frame is the tensor's storage.
            tensor = torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).view(dims)
        tensors.append(tensor)
        offset += _pad8(nbytes)
    return tensors, offset


def decode_request(payload) -> RankRequest:
    """Reads a RANK/RANK_FULL payload; raises PayloadError naming the first problem."""
    buf = memoryview(payload).cast("B")
    if len(buf) < _REQUEST_HEAD.size:
        raise PayloadError(f"request header needs 8 bytes, payload has {len(buf)}")
    count, max_batch = _REQUEST_HEAD.unpack_from(buf, 0)
    tensors, end = _read_tensors(buf, _REQUEST_HEAD.size, count, "request")
    if end != len(buf):
        raise PayloadError(f"request of {count} tensors ends at byte {end}, payload has {len(buf)}")
    return RankRequest(tensors, max_batch)


def decode_response(payload) -> RankResponse:
    buf = memoryview(payload).cast("B")
    if len(buf) < _RESPONSE_HEAD.size:
        raise PayloadError(f"response header needs 24 bytes, payload has {len(buf)}")
    queue_us, compute_us, batch, depth, count, _ = _RESPONSE_HEAD.unpack_from(buf, 0)
    tensors, end = _read_tensors(buf, _RESPONSE_HEAD.size, count, "response")
    if end != len(buf):
        raise PayloadError(f"response ends at byte {end}, payload has {len(buf)}")
    return RankResponse(queue_us, compute_us, batch, depth, tensors)


def _tensor_parts(tensor: torch.Tensor) -> list[bytes | memoryview]:
    code = DTYPE_CODES.get(tensor.dtype)
    if code is None:
        raise PayloadError(f"cannot send a {tensor.dtype} tensor; expected one of {list(DTYPES)}")
    tensor = tensor.detach().cpu().contiguous()
    head = _TENSOR_HEAD.pack(code, tensor.dim(), 0, 0) + struct.pack(
        f"<{tensor.dim()}Q", *tensor.shape
    )
    nbytes = tensor.numel() * tensor.element_size()
    # A uint8 view reads any dtype's bytes (numpy has no bfloat16) without converting them.
    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if nbytes else b""
    return [head, data, bytes(_pad8(nbytes) - nbytes)]


def encode_request(tensors: list[torch.Tensor], max_batch: int = 0) -> bytes:
    """A RANK payload; `max_batch`: the router's cap on the ranker's batches (0: none)."""
    parts: list[bytes | memoryview] = [_REQUEST_HEAD.pack(len(tensors), _u32(max_batch))]
    for tensor in tensors:
        parts.extend(_tensor_parts(tensor))
    return b"".join(parts)


def _u32(value: int) -> int:
    return max(0, min(int(value), _U32_MAX))


def encode_response(
    queue_us: int,
    compute_us: int,
    batch_requests: int,
    queue_depth: int,
    tensors: list[torch.Tensor],
) -> bytes:
    head = _RESPONSE_HEAD.pack(
        _u32(queue_us), _u32(compute_us), _u32(batch_requests), _u32(queue_depth), len(tensors), 0
    )
    parts: list[bytes | memoryview] = [head]
    for tensor in tensors:
        parts.extend(_tensor_parts(tensor))
    return b"".join(parts)
