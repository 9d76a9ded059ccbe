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
from cleave.bench.loadgen import infer_body
from cleave.models import MODELS, RequestGenerator

from support.served import SCALES


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
        self.bundle = cleave.partition(model, self.example)  # its inputs' names are all alike
        return self.bundle.save(self.repo / self.name / str(version))

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
