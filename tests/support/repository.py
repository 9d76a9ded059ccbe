"""Model repositories for tests: versions of a reference model that differ in their dense
weights, in one table, or in nothing, each with requests and each version's own scores."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import cleave
import numpy as np
import torch
import torch.utils._pytree as pytree
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from cleave.bench.loadgen import infer_body
from cleave.models import MODELS, RequestGenerator

from support.served import SCALES, cached_bundle, copy_of
from support.triton import triton_inputs

OUTPUTS = ["output_0"]  # the reference dlrm's one output
# Budgets for plumbing on a machine shared with the suite, not a latency claim.
PLUMBING = '[router]\nbudget_ms = 20000\nshed = false\n[ranker]\nthreads = 1\ndevice = "cpu"\n'


class Versions:
    """Versions of one reference model, written as `REPO/NAME/VERSION/` bundles."""

    def __init__(self, repo: Path, name: str, kind: str = "dlrm"):
        self.repo, self.name, self.kind = repo, name, kind
        self.base, self.example = MODELS[kind].factory(scale=SCALES[kind], seed=0)
        self.base.eval()
        self.models: dict[int, torch.nn.Module] = {}
        self.generator = RequestGenerator(kind, scale=SCALES[kind], seed=7, min_pooling=0)

    def write(self, version: int, dense: float = 0.0, table: str | None = None) -> Path:
        """Version `version`: the base model with its dense layers scaled by 1 + `dense` and,
        when named, the parameter `table` (an embedding's weight) shifted by 0.01."""
        model = copy.deepcopy(self.base)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not name.startswith("emb"):
                    p.mul_(1.0 + dense)
            if table is not None:
                dict(model.named_parameters())[table].add_(0.01)
        self.models[version] = model
        # The suite writes the same few variants many times: each is partitioned once.
        key = self.kind if (dense, table) == (0.0, None) else f"{self.kind}{dense:+g}-{table}"
        bundle = cached_bundle(key, lambda: (model, self.example))
        path = copy_of(bundle, self.repo / self.name / str(version))
        self.bundle = cleave.load_bundle(path)  # its inputs' names are all alike
        return path

    def arrays(self, batch: int = 4) -> tuple[dict[str, np.ndarray], dict[str, list]]:
        """A request's input arrays, and {version: that version's scores} of every version
        written so far."""
        args = self.generator.batch(batch)
        with torch.inference_mode():
            want = {
                str(version): [t.double().numpy() for t in pytree.tree_leaves(model(*args))]
                for version, model in self.models.items()
            }
        named = self.bundle.named_inputs(*args)
        return {name: t.contiguous().numpy() for name, t in named.items()}, want

    def requests(self, count: int, batch: int = 4) -> list[tuple[bytes, dict[str, list]]]:
        """(KServe JSON body, {version: scores}) for `count` requests."""
        out = []
        for _ in range(count):
            arrays, want = self.arrays(batch)
            out.append((infer_body({k: torch.from_numpy(v) for k, v in arrays.items()}), want))
        return out


def version_1_of_2(root: Path) -> Versions:
    """dlrm 1, and 2 (other dense weights and table emb_l_0), its policy serving 1 only."""
    dlrm = Versions(root, "dlrm")
    dlrm.write(1)
    dlrm.write(2, dense=0.1, table="emb_l.0.weight")
    (root / "dlrm" / "model.toml").write_text("[version_policy]\nspecific = [1]\n")
    return dlrm


def plan_repository(root: Path, here: Path, *flags: str) -> Path:
    """`cleave plan ROOT FLAGS` with the plumbing settings above; the plan's path."""
    from cleave.cli import main

    config = here / "serve.toml"
    config.write_text(PLUMBING)
    plan = here / "plan.yaml"
    assert main(["plan", str(root), *flags, "--config", str(config), "-o", str(plan)]) == 0
    return plan


def corrupt(bundle: Path) -> None:
    """A bundle whose manifest is not JSON any more."""
    (bundle / "manifest.json").write_text("{ not json")


def break_probe(bundle: Path) -> None:
    """A bundle whose recorded probe outputs disagree with its dense program: a ranker refuses
    to serve it (python/cleave/ranker/program.py, check_probe)."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    probe_file = bundle / manifest["dense"]["probe"]
    probe = torch.load(probe_file, weights_only=True)
    probe["outputs"] = [o + 1.0 for o in probe["outputs"]]
    torch.save(probe, probe_file)


def max_error(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    return max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))


def http_client(server):
    """tritonclient's HTTP client of a ServeProcess's router."""
    return httpclient.InferenceServerClient(url=server.url.removeprefix("http://"))


def infer_version(client, versions: Versions, model="dlrm", version="", headers=None):
    """One request through tritonclient (HTTP or gRPC): (the version that answered, its error
    from that version's own model's scores)."""
    arrays, want = versions.arrays(3)
    grpc = isinstance(client, grpcclient.InferenceServerClient)
    inputs = triton_inputs(grpcclient if grpc else httpclient, arrays)
    result = client.infer(model, inputs, model_version=version, headers=headers)
    response = result.get_response()
    served = response.model_version if grpc else response["model_version"]
    got = [result.as_numpy(name).astype(np.float64) for name in OUTPUTS]
    return served, max_error(got, want[served])


def repository_index(client) -> dict[tuple[str, str], str]:
    """(model, version) -> state, from tritonclient's repository index (HTTP or gRPC)."""
    index = client.get_model_repository_index()
    if not isinstance(index, list):  # gRPC: a message
        index = [{"name": m.name, "version": m.version, "state": m.state} for m in index.models]
    return {(m["name"], m["version"]): m["state"] for m in index}
