"""KServe's Python SDK inference clients, unmodified, against a running `cleave serve`: run by
tests/test_tritonclient.py as its own process, because the `kserve` and `tritonclient.grpc`
packages register the same protobuf names (`inference.ServerLiveRequest`, ...) and cannot be
imported into one process.

    python tests/kserve_client.py CASES.npz REST_URL GRPC_TARGET MODEL OUTPUT...

CASES.npz holds `in{i}_{name}` inputs and `want{i}_{k}` scores for each request i. Exits 0 when
every score is within 1e-5 over gRPC and over REST, else prints what differed and exits 1.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np

TOLERANCE = 1e-5


def cases(npz) -> list[tuple[dict, list]]:
    out = []
    i = 0
    while any(k.startswith(f"in{i}_") for k in npz.files):
        arrays = {k.split("_", 1)[1]: npz[k] for k in npz.files if k.startswith(f"in{i}_")}
        want = [
            npz[f"want{i}_{k}"] for k in range(sum(f.startswith(f"want{i}_") for f in npz.files))
        ]
        out.append((arrays, want))
        i += 1
    return out


async def main(path: str, url: str, target: str, model: str, outputs: list[str]) -> int:
    from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest
    from kserve.inference_client import RESTConfig
    from tritonclient.utils import np_to_triton_dtype

    def request(arrays: dict) -> InferRequest:
        inputs = []
        for name, arr in arrays.items():
            inp = InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        return InferRequest(model, inputs)

    failures = []

    def check(response, want, what):
        got = {o.name: o.as_numpy() for o in response.outputs}
        for name, w in zip(outputs, want, strict=True):
            g = np.asarray(got[name], dtype=np.float64).reshape(w.shape)
            if np.abs(g - w).max() > TOLERANCE:
                failures.append(f"{what}: {name} differs by {np.abs(g - w).max()}")

    grpc_client = InferenceGRPCClient(url=target)
    rest_client = InferenceRESTClient(config=RESTConfig(protocol="v2"))
    try:
        if not await grpc_client.is_server_ready():
            failures.append("gRPC: server not ready")
        for i, (arrays, want) in enumerate(cases(np.load(path))):
            check(await grpc_client.infer(request(arrays)), want, f"gRPC request {i}")
            check(await rest_client.infer(url, request(arrays), model), want, f"REST request {i}")
    finally:
        await grpc_client.close()
        await rest_client.close()
    print("\n".join(failures) or "ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(*sys.argv[1:5], sys.argv[5:])))
