"""The enumerated values of settings, one list each. Python reads them here; the Helm chart
and the Rust crates get them from the generated deploy/helm/cleave/files/settings.json (their
tests compare their own names with it)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Choices:
    """The names a setting accepts. An alias is an older name that still works, with a
    warning, and means the name it maps to."""

    names: tuple[str, ...]
    aliases: dict[str, str] = field(default_factory=dict)

    def __contains__(self, value: object) -> bool:
        return value in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def expected(self) -> str:
        """`"fifo" or "edf"`, `"auto", "cpu" or "cuda"`: for error messages."""
        quoted = [f'"{n}"' for n in self.names]
        return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"

    def canonical(self, value: object, key: str) -> object:
        """`value`, or the name an alias stands for (with a FutureWarning naming `key`).
        Anything else comes back unchanged, for the checks to report."""
        if isinstance(value, str) and value in self.aliases:
            name = self.aliases[value]
            warnings.warn(
                f"{key}: {value!r} is deprecated, use {name!r} (same behaviour)",
                FutureWarning,
                stacklevel=2,
            )
            return name
        return value

    def parse(self, flag: str):
        """An argparse `type` for `flag`: an alias becomes its name (with the warning); use
        with `choices=CHOICES.names`."""
        return lambda value: self.canonical(value, flag)


# The order waiting requests start in at shards and rankers (cleave_wire::queue,
# cleave/ranker/queues/). "fcfs" was the incast queue's name for fifo; it works here too.
QUEUE_POLICIES = Choices(("fifo", "edf", "lifo"), {"fcfs": "fifo"})
# The order a ranker grants delayed requests-to-send in (cleave_flow::queue, docs/traffic.md).
INCAST_ORDERS = Choices(("fifo", "edf"), {"fcfs": "fifo"})
# The router's admission rule (crates/cleave-router/src/admission/): an adaptive limit on the
# work in flight to the backends, or the latency estimate against the budget (the old rule).
ADMISSION_RULES = Choices(("adaptive", "estimate"))
# Internal sockets: Unix sockets (every role on one host), shared memory (Unix sockets for the
# headers, payloads passed by reference through memfd regions: docs/protocol.md,
# "Shared-memory transport"; every role on one host), TCP, or mptcp: TCP addresses over
# Multipath TCP sockets (docs/protocol.md, "Multipath TCP"). Their address forms:
# cleave.settings.addresses.
TRANSPORTS = Choices(("unix", "shm", "tcp", "mptcp"))
# The router's embedding cache (docs/cache.md).
CACHE_MODES = Choices(("off", "fixed", "adaptive"))


DEVICES = Choices(("auto", "cpu", "cuda"))
# How shards split the tables (cleave/plan/planner.py, table_ranges): every table cut into
# row ranges, or whole tables spread over the shards (what `cleave score`'s ranks hold).
TABLE_LAYOUTS = Choices(("rows", "tables"))
# How a bundle stores its embedding tables (cleave/bundle/tables.py, cleave_embed::bundle), and
# the shorter names `cleave partition --table-dtype` also takes for the row-wise ones.
TABLE_DTYPES = Choices(("float32", "float16", "int8_rowwise", "int4_rowwise"))
TABLE_DTYPE_SHORT_NAMES = {"int8": "int8_rowwise", "int4": "int4_rowwise"}
# The precision a bundle's dense program runs at (cleave/bundle/precision.py).
DENSE_DTYPES = Choices(("float32", "bfloat16", "int8"))
# What a ranker serves: one of them, or "auto" (cleave/ranker/dense_dtype.py, docs/bundle.md).
RANKER_DENSE_DTYPES = Choices(("auto", *DENSE_DTYPES.names))
# A plan's mode; `cleave serve`'s monolithic and router_held flags choose among the same.
MODES = Choices(("disaggregated", "monolithic", "router-held"))
