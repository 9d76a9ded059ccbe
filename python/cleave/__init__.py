"""Cleave: serve deep learning recommendation models disaggregated.

`partition(model, example_inputs)` cuts a model into a `Bundle` (sparse lookups + dense
program); `load_bundle(path)` reads one back. Servers live in `cleave.launch`.
"""

from cleave.errors import BundleError, CleaveError, UnsupportedModelError, UsageError

__all__ = [
    "Bundle",
    "BundleError",
    "CleaveError",
    "UnsupportedModelError",
    "UsageError",
    "load_bundle",
    "partition",
]


def __getattr__(name: str):
    # Lazy: importing `cleave` must not import torch (shard processes never need it).
    if name == "partition":
        from cleave.partitioner import partition

        return partition
    if name in ("Bundle", "load_bundle"):
        from cleave import bundle

        return getattr(bundle, name)
    raise AttributeError(f"module 'cleave' has no attribute {name!r}")
