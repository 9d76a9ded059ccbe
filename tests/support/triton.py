"""Triton's client as a user writes it (tritonclient's InferInput from numpy), for the
tritonclient and KServe SDK tests: a reference model's bundle with requests and scores, and
sync then asyncio round trips, each score checked."""

from __future__ import annotations

import asyncio

import numpy as np
import torch
import torch.utils._pytree as pytree
from cleave.models import RequestGenerator
from tritonclient.utils import np_to_triton_dtype

from support.served import SCALES, TOLERANCE, Served


def inputs_and_scores(model, bundle, generator, batch: int):
    args = generator.batch(batch)
    with torch.inference_mode():
        want = [t.double().numpy() for t in pytree.tree_leaves(model(*args))]
    arrays = {name: t.contiguous().numpy() for name, t in bundle.named_inputs(*args).items()}
    return arrays, want


def triton_inputs(client_module, arrays: dict) -> list:
    """What a tritonclient user writes: one InferInput per array, data set from numpy."""
    inputs = []
    for name, arr in arrays.items():
        inp = client_module.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


def check(result, output_names: list[str], want: list[np.ndarray], what: str) -> None:
    for name, w in zip(output_names, want, strict=True):
        got = result.as_numpy(name)
        assert got is not None, (what, name)
        assert got.shape == w.shape, (what, got.shape, w.shape)
        assert np.abs(got.astype(np.float64) - w).max() <= TOLERANCE, what


def served_model(tmp_path, name: str):
    """A reference model, its saved bundle and three requests (batches 1, 13, 64) with the
    model's own scores."""
    served = Served(name, tmp_path)
    generator = RequestGenerator(name, scale=SCALES[name], seed=5, min_pooling=0)
    requests = [inputs_and_scores(served.model, served.bundle, generator, b) for b in (1, 13, 64)]
    return served.dir, requests


def triton_round_trips(sync_module, async_module, url, model_name, outputs, requests, what):
    """What a tritonclient user does, sync then asyncio, each score checked: every request,
    one with its outputs named, then all of them at once."""
    client = sync_module.InferenceServerClient(url=url)
    try:
        assert client.is_server_live()
        assert client.is_model_ready(model_name)
        for arrays, want in requests:
            result = client.infer(model_name, triton_inputs(sync_module, arrays))
            check(result, outputs, want, f"{what} sync")
        # Outputs named explicitly (binary on HTTP: the client's default for them too).
        arrays, want = requests[1]
        asked = [sync_module.InferRequestedOutput(o) for o in outputs]
        result = client.infer(model_name, triton_inputs(sync_module, arrays), outputs=asked)
        check(result, outputs, want, f"{what} sync, outputs named")
    finally:
        client.close()

    async def run_async():
        aclient = async_module.InferenceServerClient(url=url)
        try:
            assert await aclient.is_server_live()
            results = await asyncio.gather(
                *(
                    aclient.infer(model_name, triton_inputs(async_module, arrays))
                    for arrays, _ in requests
                )
            )
        finally:
            await aclient.close()
        for result, (_, want) in zip(results, requests, strict=True):
            check(result, outputs, want, f"{what} async")

    asyncio.run(run_async())
