"""The dense program's stored graph (cleave.bundle.graph, docs/bundle.md "dense"): the module a
ranker builds from it is the torch.export program's, bit for bit, and a ranker starts without
torch.export's deserializer and TorchDynamo."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import cleave
import pytest
import torch
import torch.utils._pytree as pytree
from cleave.bundle import graph as graph_io
from cleave.bundle.precision import convert

# dlrm: a plain program; din: a per-request input, so a batched program too.
MODELS = ("dlrm", "din")


def dense_inputs(served, batch: int, batched: bool) -> list[torch.Tensor]:
    bundle = served.bundle
    named = bundle.named_inputs(*served.generator.batch(batch))
    values = {**named, **bundle.sparse_reference(named)}
    tensors = [values[n] for n in bundle.manifest["dense"]["inputs"]]
    if batched:  # per-request inputs expanded to a row per sample, as the ranker joins them
        per_request = set(bundle.per_request_inputs)
        rows = max(t.shape[0] for t in tensors)
        names = bundle.manifest["dense"]["inputs"]
        tensors = [
            t.expand(rows, *t.shape[1:]) if n in per_request else t
            for n, t in zip(names, tensors, strict=True)
        ]
    return tensors


def run(module, inputs) -> list[torch.Tensor]:
    with torch.inference_mode():
        return pytree.tree_leaves(module(*inputs))


@pytest.mark.parametrize("name", MODELS)
def test_the_stored_graph_is_the_program(models, name):
    served = models[name]
    manifest = json.loads((served.dir / "manifest.json").read_text())
    fast = cleave.load_bundle(served.dir, verify=False, stored_graphs=True)
    slow = cleave.load_bundle(served.dir, verify=False)
    variants = [False] + ([True] if manifest["dense"].get("batched", {}).get("program") else [])
    assert (name == "din") == (variants == [False, True])
    for batched in variants:
        meta = manifest["dense"]["batched"] if batched else manifest["dense"]
        assert (served.dir / meta["graph"]).is_file()
        mine, theirs = fast.dense_module("float32", batched), slow.dense_module("float32", batched)
        assert graph_io.same_code(mine, theirs)
        for dtype in ("float32", "bfloat16"):
            a, b = convert(mine, dtype), convert(theirs, dtype)
            for batch in (1, 7, 64):
                inputs = dense_inputs(served, batch, batched)
                assert all(map(torch.equal, run(a, inputs), run(b, inputs))), (dtype, batch)
    assert fast._dense is None  # the torch.export program was never read


def test_the_stored_graph_checks_its_inputs_as_the_program_does(models):
    served = models["dlrm"]
    fast = cleave.load_bundle(served.dir, verify=False, stored_graphs=True).dense_module()
    slow = cleave.load_bundle(served.dir, verify=False).dense_module()
    inputs = dense_inputs(served, 3, False)
    inputs[0] = inputs[0][:, :-1]  # dense_x one feature short
    for module in (fast, slow):
        with pytest.raises(AssertionError, match=r"Guard failed: dense_x.size\(\)\[1\] == 13"):
            run(module, inputs)


def test_old_and_damaged_graphs(models, tmp_path):
    served = models["dlrm"]
    old = shutil.copytree(served.dir, tmp_path / "old")
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["dense"]["graph"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    (old / "dense_graph.pt").unlink()
    # A bundle from before stored graphs: its archive is read.
    bundle = cleave.load_bundle(old, stored_graphs=True)
    bundle.dense_module("float32")
    assert bundle._dense is not None
    # Saving it again writes the graph.
    again = cleave.load_bundle(old, stored_graphs=True).save(tmp_path / "again")
    assert (again / "dense_graph.pt").is_file()
    assert json.loads((again / "manifest.json").read_text())["dense"]["graph"] == "dense_graph.pt"

    (again / "dense_graph.pt").write_bytes(b"garbage")
    with pytest.raises(cleave.BundleError, match="dense_graph.pt.*cannot read"):
        cleave.load_bundle(again, stored_graphs=True).dense_module()
    (again / "dense_graph.pt").unlink()
    with pytest.raises(cleave.BundleError, match="dense_graph.pt.*missing"):
        cleave.load_bundle(again, stored_graphs=True).dense_module()


def test_a_stored_graph_that_would_run_other_code_is_refused(models, tmp_path):
    """A stored graph is code read from a file: a guard reaching past the inputs' sizes (here
    to torch.hub), or a node calling something other than an operator, makes the graph
    unreadable, not code that runs."""
    copy = shutil.copytree(models["dlrm"].dir, tmp_path / "bundle")
    data = torch.load(copy / "dense_graph.pt", weights_only=True)
    data["guards"][0][0] = "torch.hub.list('somewhere') is None"
    torch.save(data, copy / "dense_graph.pt")
    with pytest.raises(cleave.BundleError, match="dense_graph.pt.*guard.*reads"):
        cleave.load_bundle(copy, stored_graphs=True).dense_module()
    # A node may call operators and a few plain functions, never torch.save and the like.
    data = torch.load(models["dlrm"].dir / "dense_graph.pt", weights_only=True)
    next(n for n in data["nodes"] if n["op"] == "call_function")["target"] = "torch.save"
    torch.save(data, copy / "dense_graph.pt")
    with pytest.raises(cleave.BundleError, match="unknown function 'torch.save'"):
        cleave.load_bundle(copy, stored_graphs=True).dense_module()


def test_a_ranker_starts_without_torch_export(models):
    """The point of the stored graph: a ranker process imports neither torch.export's
    serializer nor TorchDynamo (about 2 s of CPU per start)."""
    served = models["dlrm"]
    code = (
        "import sys\n"
        "from cleave.ranker.program import load_ranker\n"
        f"load_ranker({str(served.dir)!r}, None, device='cpu', threads=1)\n"
        "heavy = ['torch._dynamo', 'torch._export.serde.serialize', 'torch._inductor', 'sympy']\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
