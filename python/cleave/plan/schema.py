"""The deployment plan (docs/plan.md): which role runs on which logical host, on which logical
port, with which settings. Pure data: no addresses, no processes, no secrets. Runners (local
processes, the testbed, Ray, Helm) bind the real addresses and start what it describes.

Fields without a default are required in the YAML. Role settings are concrete (a ranker's
`threads` is a number, never "auto"), so runners never need to know a default."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cleave.settings import (
    MODES,
    TRANSPORTS,
    IncastConfig,
    PlanSettings,
    RankerConfig,
    RouterConfig,
    ShardConfig,
    canonical_choices,
    required,
    same_as,
)

FORMAT = "cleave-plan"
VERSION = 1


@dataclass
class Host:
    """A logical host: what it offers, and labels a runner may map to real machines."""

    name: str
    cpus: int
    memory_gib: float
    gpus: int
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Shard:
    """One embedding shard process. Shards with the same `group` are replicas: same ranges."""

    name: str
    group: int
    host: str
    port: int  # frame protocol (docs/protocol.md); 0: the runner picks one
    metrics_port: int  # /metrics, /ready, /live; 0: the runner picks one
    threads: int = same_as(ShardConfig, "threads", required=True)
    ranges: dict[str, tuple[int, int]]  # table -> [row_start, row_end)
    queue: str = same_as(ShardConfig, "queue")
    dram_budget: int = same_as(ShardConfig, "dram_budget")
    # Placement across tiers (docs/tiers.md, `cleave plan --profile`): the tables read from
    # SSD; the rest stay in DRAM within dram_budget. Empty: every table on SSD if they exceed it.
    ssd_tables: list[str] = field(default_factory=list)
    # The access profile whose hottest rows warm the row cache; relative to the plan file.
    profile: str = ""
    # Where this shard keeps model updates (`cleave update`, docs/tiers.md "Updates"); relative
    # to the plan file; one directory per shard. "": updates are refused.
    state_dir: str = ""
    # In a repository plan (docs/plan.md, "Repository plans"): the model version whose new
    # tables this shard holds. "" and 0: a plan of one bundle.
    model: str = ""
    version: int = 0

    def __post_init__(self) -> None:
        canonical_choices(self, f"shard {self.name}: ")


@dataclass
class Ranker:
    """One ranker process; the settings are `cleave ranker`'s flags."""

    name: str
    host: str
    port: int
    metrics_port: int
    device: str = same_as(RankerConfig, "device", required=True)
    threads: int = same_as(RankerConfig, "threads", required=True)  # a number, never 0 here
    max_batch: int = same_as(RankerConfig, "max_batch", required=True)
    max_wait_ms: float = same_as(RankerConfig, "max_wait_ms", required=True)
    max_queue: int = same_as(RankerConfig, "max_queue", required=True)
    cuda_graphs: bool = same_as(RankerConfig, "cuda_graphs", required=True)
    compile: bool = same_as(RankerConfig, "compile")
    dense_dtype: str = same_as(RankerConfig, "dense_dtype")
    compile_cache: str = same_as(RankerConfig, "compile_cache")
    shared_batching: bool = same_as(RankerConfig, "shared_batching")
    eager_model: str = same_as(RankerConfig, "eager_model")
    queue: str = same_as(RankerConfig, "queue")
    # Incast control (docs/traffic.md): the control port routers ask before sending a large
    # payload, on the ranker's host; 0: none. Used when the plan's `incast_control` is on.
    control_port: int = 0
    incast_window_bytes: int = same_as(IncastConfig, "incast_window_bytes")
    incast_adaptive: bool = same_as(IncastConfig, "incast_adaptive")
    incast_order: str = same_as(IncastConfig, "incast_order")
    link_gbit: float = same_as(IncastConfig, "link_gbit")
    # In a repository plan: the model version whose dense program it runs ("" and 0: a plan
    # of one bundle).
    model: str = ""
    version: int = 0

    def __post_init__(self) -> None:
        canonical_choices(self, f"ranker {self.name}: ")


@dataclass
class Router:
    """One router process. It serves /metrics, /v2/health/* on its http_port."""

    name: str
    host: str
    http_port: int  # the client port; 0: the runner picks one
    grpc_port: int | None = None  # KServe v2 gRPC port; None: no gRPC; 0: an ephemeral one


@dataclass
class Supervision:
    """How runners start and stop roles (ServeConfig's top-level timeouts)."""

    fail_stop: bool  # a role that dies stops the deployment (default: restart it)
    ready_timeout_s: float  # start-up budget of a group of roles
    stop_timeout_s: float  # SIGTERM -> SIGKILL grace


@dataclass
class Plan:
    name: str  # model name in the URLs
    # A bundle, or a model repository (a repository plan: plan/repository.py); relative paths
    # resolve against the plan file's directory.
    bundle: str
    # monolithic: the baseline, one ranker runs the whole model; router-held: routers hold
    # every table, no shards.
    mode: str = required("how the model is split across processes", MODES)
    transport: str = required(
        "internal sockets (unix, shm: every role on one host; mptcp: TCP over every NIC)",
        TRANSPORTS,
    )
    hosts: list[Host]
    shards: list[Shard]
    rankers: list[Ranker]
    routers: list[Router]
    # Every router's settings: RouterConfig's fields, read from the dataclass, so a new router
    # key needs no change here. Keys left out of a file take RouterConfig's defaults.
    router: RouterConfig
    supervision: Supervision
    # Incast control (docs/traffic.md): routers ask each ranker's control port for a grant
    # before sending a fused payload of at least `incast_threshold_bytes`. Needs every
    # ranker's `control_port` (a runner picks one where it is 0).
    incast_control: bool = same_as(PlanSettings, "incast_control")
    incast_threshold_bytes: int = same_as(PlanSettings, "incast_threshold_bytes")
    # The file this plan was read from: names it in errors, anchors a relative bundle path.
    source: Path | None = field(default=None, compare=False, metadata={"serialise": False})
    # Why each role is where it is, and the placement's cost (topology-aware plans only);
    # written as comments at the head of the plan file.
    placement: list[str] = field(default_factory=list, compare=False, metadata={"serialise": False})

    def bundle_path(self) -> Path:
        path = Path(self.bundle)
        if path.is_absolute() or self.source is None:
            return path
        return self.source.parent / path

    def where(self) -> str:
        return str(self.source) if self.source is not None else "plan"

    def host(self, name: str) -> Host | None:
        return next((h for h in self.hosts if h.name == name), None)

    def roles(self) -> list[tuple[str, Shard | Ranker | Router]]:
        """Every role with its field path (`shards[2]`), in file order."""
        return [
            *((f"shards[{i}]", s) for i, s in enumerate(self.shards)),
            *((f"rankers[{i}]", r) for i, r in enumerate(self.rankers)),
            *((f"routers[{i}]", r) for i, r in enumerate(self.routers)),
        ]

    def validate(self) -> list[str]:
        """`check` against the plan's bundle, or, for a repository plan, each carried
        version against its own bundle (plan/repository.py): the warnings, or UsageError."""
        from cleave.bundle import manifest as manifest_io
        from cleave.plan.repository import check_repository_plan, is_repository_plan

        if is_repository_plan(self):
            return check_repository_plan(self)
        return self.check(manifest_io.read(self.bundle_path(), whole=False))

    def check(self, manifest: dict) -> list[str]:
        """Raise UsageError listing every problem against the bundle's manifest; return the
        warnings (a host's cores oversubscribed, say)."""
        from cleave.plan.check import check_plan

        return check_plan(self, manifest)
