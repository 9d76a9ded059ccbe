"""A bundle: a model cut into sparse lookups (tables + features) and a dense program.

`Bundle` and `load_bundle` (cleave.bundle.bundle) need torch and are imported when first
used; the metadata (cleave.bundle.manifest) and the table files (cleave.bundle.tables) read
without it, so a launcher, a planner or a shard never pays for importing torch.
"""

from __future__ import annotations

__all__ = ["Bundle", "load_bundle"]


def __getattr__(name: str):
    if name in __all__:
        from cleave.bundle import bundle

        return getattr(bundle, name)
    raise AttributeError(f"module 'cleave.bundle' has no attribute {name!r}")
