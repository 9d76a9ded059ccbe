"""The eager baseline: the original PyTorch model, as its author saved it (`torch.save` of the
module), run as it is by a monolithic ranker over the bundle's flat inputs. It is what a team
serving its TorchRec model with PyTorch alone would run; `cleave bench serve` measures Cleave
against it (docs/serving.md, "The eager baseline").

The bundle's inputs are the forward's arguments in order, each a tensor or a
KeyedJaggedTensor (`p.values`, `p.weights`, `p.lengths`); the KJT is rebuilt from them, so
loading such a model imports TorchRec (its pickle names TorchRec's classes).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
import torch.utils._pytree as pytree

from cleave.errors import UsageError


def load_eager(path: str | Path, manifest: dict) -> torch.nn.Module:
    """The saved model at `path`, wrapped to take the manifest's flat inputs."""
    try:
        # A whole pickled module: code runs as it loads, so only the operator's own file.
        model = torch.load(path, weights_only=False, map_location="cpu")
    except Exception as err:
        raise UsageError(
            f"--eager-model {path}: expected a model saved with torch.save(module), got {err}"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise UsageError(
            f"--eager-model {path}: expected a saved torch.nn.Module, got {type(model).__name__}"
        )
    return EagerModel(model.eval(), manifest)


class EagerModel(torch.nn.Module):
    """(*manifest inputs) -> tuple of the model's flat outputs, the model run eagerly."""

    def __init__(self, model: torch.nn.Module, manifest: dict):
        super().__init__()
        self.model = model
        self.kjts = {k["name"]: k["keys"] for k in manifest.get("kjts", [])}
        names = [t["name"] for t in manifest["inputs"]]
        # Each forward argument: a tensor's position, or a KJT's name (its fields' positions
        # are in `self.fields`).
        self.arguments: list[int | str] = []
        self.fields: dict[str, dict[str, int]] = {}
        for i, name in enumerate(names):
            kjt, _, field = name.rpartition(".")
            if kjt not in self.kjts:
                self.arguments.append(i)
                continue
            if kjt not in self.fields:
                self.arguments.append(kjt)
            self.fields.setdefault(kjt, {})[field] = i
        if self.kjts:
            from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

            self.kjt_class = KeyedJaggedTensor
        parameters = [
            p
            for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if len(parameters) != len(self.arguments):
            raise UsageError(
                f"the eager model's forward takes {len(parameters)} arguments "
                f"({', '.join(p.name for p in parameters)}), but the bundle's inputs make "
                f"{len(self.arguments)} ({', '.join(names)}): the eager baseline runs models "
                "whose arguments are each a tensor or a KeyedJaggedTensor"
            )

    def forward(self, *inputs: torch.Tensor) -> tuple:
        args = []
        for argument in self.arguments:
            if isinstance(argument, int):
                args.append(inputs[argument])
                continue
            fields = {field: inputs[i] for field, i in self.fields[argument].items()}
            args.append(
                self.kjt_class(
                    keys=self.kjts[argument],
                    values=fields["values"],
                    weights=fields.get("weights"),
                    lengths=fields["lengths"],
                )
            )
        return tuple(pytree.tree_leaves(self.model(*args)))
