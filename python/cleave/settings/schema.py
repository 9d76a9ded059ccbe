"""Every role's settings: name, type, default, one-line doc and allowed values, declared once
here. `cleave serve`'s TOML ([router], [shard], [ranker] and the top level), a plan's role
settings, the launchers' command lines, the router's JSON, the Helm chart's defaults and the
docs' settings table are all read from (or checked against) these dataclasses; see
`python -m cleave.settings` for the generated files. Adding a setting is one `setting(...)`
here plus its use."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from cleave.errors import UsageError
from cleave.settings.choices import (
    ADMISSION_RULES,
    CACHE_MODES,
    DEVICES,
    INCAST_ORDERS,
    QUEUE_POLICIES,
    RANKER_DENSE_DTYPES,
    TABLE_LAYOUTS,
    TRANSPORTS,
    Choices,
)


def setting(default: Any, doc: str, choices: Choices | None = None) -> Any:
    """A setting's dataclass field: its default, a one-line doc, its allowed values."""
    return field(default=default, metadata={"doc": doc, "choices": choices})


def required(doc: str, choices: Choices | None = None) -> Any:
    """A setting without a default (a plan's file must give it)."""
    return field(metadata={"doc": doc, "choices": choices})


def same_as(cls: type, name: str, *, required: bool = False) -> Any:
    """The field `name` of settings class `cls`, for a class that carries the same setting
    (a plan's role): one default, one doc, one list of choices. `required`: without the
    default (a plan states every role setting)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if required:
        return field(metadata=f.metadata)
    return field(default=f.default, metadata=f.metadata)


def doc(cls: type, name: str) -> str:
    return next(f for f in dataclasses.fields(cls) if f.name == name).metadata["doc"]


def choice_list(cls: type, name: str) -> Choices | None:
    return next(f for f in dataclasses.fields(cls) if f.name == name).metadata.get("choices")


def default(cls: type, name: str) -> Any:
    return next(f for f in dataclasses.fields(cls) if f.name == name).default


def flags(obj: Any, cls: type) -> list[str]:
    """The command-line flags (`--max-batch 256`) for the settings of `cls` that `obj` carries.
    A bool is a flag that turns it away from its default (`--compile`, `--no-cuda-graphs`);
    a value equal to a default of 0 or "" (off, or automatic) is left out."""
    argv: list[str] = []
    for f in dataclasses.fields(cls):
        value, flag = getattr(obj, f.name), f.name.replace("_", "-")
        if isinstance(value, bool):
            if value != f.default:
                argv.append(f"--{flag}" if value else f"--no-{flag}")
        elif not (value == f.default and not f.default):
            argv += [f"--{flag}", str(value)]
    return argv


def choice_problems(obj: Any, where: str) -> list[str]:
    """`WHERE.KEY: expected "a" or "b", got 'c'` for each choice setting of `obj` off its list."""
    problems = []
    for f in dataclasses.fields(obj):
        choices = f.metadata.get("choices")
        value = getattr(obj, f.name)
        if choices is not None and value not in choices:
            problems.append(f"{where}{f.name}: expected {choices.expected()}, got {value!r}")
    return problems


def canonical_choices(obj: Any, where: str = "") -> None:
    """Replaces an alias of a choice setting by its name (warning that it is deprecated)."""
    for f in dataclasses.fields(obj):
        choices = f.metadata.get("choices")
        if choices is not None:
            value = getattr(obj, f.name)
            setattr(obj, f.name, choices.canonical(value, f"{where}{f.name}"))


@dataclass
class RouterConfig:
    """[router] of `cleave serve`'s TOML; a plan's `router:` (every router of the plan)."""

    budget_ms: float = setting(1000.0, "latency budget of a request that names none")
    max_budget_ms: float = setting(60000.0, "the largest budget a request may ask for")
    body_limit_mb: float = setting(64.0, "larger request bodies get 413")
    connect_timeout_ms: int = setting(1000, "connecting to a shard or ranker")
    health_interval_ms: int = setting(1000, "how often backends are probed for readiness")
    ranker_connections: int = setting(2, "connections kept to each ranker")
    threads: int = setting(2, "router I/O threads (HTTP and backends), at most its cores")
    header_timeout_ms: int = setting(
        10000, "a started request head must arrive whole within this (docs/api.md)"
    )
    idle_timeout_ms: int = setting(
        60000, "a connection with no request in progress closes after this"
    )
    body_min_bytes_per_s: int = setting(16384, "slower bodies get 408 (after body_grace_ms)")
    body_grace_ms: int = setting(
        2000, "how long a body may take before its rate is held to the minimum"
    )
    max_connections: int = setting(16384, "open client connections; more are refused with 503")
    max_in_flight: int = setting(2048, "requests in progress; more are shed with 503")
    shed: bool = setting(True, "shed at once (503) when the admission rule says no")
    admission: str = setting(
        "adaptive",
        "limit work in flight adaptively, or shed by a latency estimate",
        ADMISSION_RULES,
    )
    admit_share: float = setting(
        0.5, "the share of its budget a request's estimate (adaptive: latency) may fill"
    )
    max_retry_after_s: int = setting(
        60, "the longest Retry-After (seconds) a shed request is told to wait"
    )
    # Never the token itself (docs/serving.md, "Replicas and membership").
    admin_token_env: str = setting(
        "", 'environment variable holding the admin API\'s bearer token; "": no token'
    )
    # A range's only replica (or the retry) may always use the rest of the budget.
    shard_timeout_ms: int = setting(
        0,
        "longest wait for one shard replica before one retry on another; "
        "0: half of what is left of the budget",
    )
    response_credits: int = setting(
        0,
        "each shard data connection's initial credit window in bytes, at least the largest "
        "shard response (docs/protocol.md); 0: off",
    )
    auth_token_file: str = setting(
        "", "file of bearer tokens clients must send on REST and gRPC (docs/security.md)"
    )
    tls_cert: str = setting("", "PEM certificate chain for TLS on both client ports")
    tls_key: str = setting("", 'PEM private key for TLS; "": plain TCP')
    # The embedding cache in front of the shards (docs/cache.md).
    cache: str = setting(
        "off", "hot rows and pooled bags kept by the router (see docs/cache.md)", CACHE_MODES
    )
    cache_bytes: int = setting(0, "fixed: the cache's bytes; adaptive: its largest (0: budget)")
    memory_budget_bytes: int = setting(
        0, "memory the cache and the rankers' batch activations share on the host; 0: none"
    )
    activation_bytes_per_sample: int = setting(
        0, "the rankers' memory per row of a batch; 0: measured by the rankers at start"
    )
    cache_window: int = setting(64, "ranker replies in the adaptive cache's sliding window")
    # Every shard, ranker and router connection then proves it in its HELLO. Never the secret.
    internal_secret_env: str = setting(
        "", "environment variable holding the deployment's internal secret (docs/security.md)"
    )


@dataclass
class ShardConfig:
    """[shard] of `cleave serve`'s TOML; the defaults of a plan's `shards[i]`."""

    threads: int = setting(1, "lookup threads per shard")
    queue: str = setting(
        "fifo", "order received lookups start in (see Queue policies)", QUEUE_POLICIES
    )
    dram_budget: int = setting(
        0,
        "bytes of DRAM for the rows; larger tables are read from SSD behind DRAM caches of "
        "this size (docs/tiers.md); 0: all in DRAM",
    )


@dataclass
class RankerConfig:
    """[ranker] of `cleave serve`'s TOML; the defaults of a plan's `rankers[i]` and of
    `cleave ranker`'s flags."""

    device: str = setting("auto", "where the dense program runs", DEVICES)
    dense_dtype: str = setting(
        "auto",
        "the dense program's precision; auto: the fastest the bundle approves (docs/bundle.md)",
        RANKER_DENSE_DTYPES,
    )
    threads: int = setting(
        0, "torch CPU threads per ranker; 0: by the bundle's measured demand (see Cores)"
    )
    # 256 rather than 1,024, which answered 1.2-1.3x the 100-candidate requests of a 1 s
    # budget in overload on a 2-core guest but raised the closed-loop capacity that tight
    # budgets' overload goodput is judged against, with their goodput unchanged
    # (docs/benchmarks.md, "Batches of 1,024 rows"). Deadlines cap a batch either way
    # (cleave/ranker/batcher.py).
    max_batch: int = setting(256, "rows per batch at most")
    max_wait_ms: float = setting(
        0.0, "how long a request may wait for company; 0: work-conserving (see Batching)"
    )
    max_queue: int = setting(
        1024, "requests waiting at most; more are refused `overloaded` at once"
    )
    queue: str = setting(
        "fifo", "order waiting requests start in (see Queue policies)", QUEUE_POLICIES
    )
    cuda_graphs: bool = setting(True, "replay CUDA batches as graphs")
    compile: bool = setting(
        False, "compile the dense program with TorchInductor before ready (CPU)"
    )
    compile_cache: str = setting(
        "", 'where compiled programs are kept; "": $XDG_CACHE_HOME/cleave/inductor'
    )
    shared_batching: bool = setting(
        True, "join a shared-input model's requests (bundle permitting; see Batching)"
    )
    eager_model: str = setting(
        "", "monolithic only: run this torch.save'd model eagerly (see The eager baseline)"
    )


@dataclass
class PlanSettings:
    """A deployment's own settings, beside its roles' (a plan's top level). Incast control
    (docs/traffic.md): routers ask each ranker's control port for a grant before sending a
    fused payload of at least `incast_threshold_bytes`."""

    incast_control: bool = setting(False, "routers ask rankers for a grant before large payloads")
    incast_threshold_bytes: int = setting(64 << 10, "payloads this large or larger need a grant")


@dataclass
class IncastConfig:
    """A ranker's incast control (docs/traffic.md): a plan's `rankers[i]` and `cleave ranker`'s
    flags; used when the plan's `incast_control` is on."""

    incast_window_bytes: int = setting(
        1 << 20, "bytes granted and not yet received at most (one payload alone always goes)"
    )
    incast_adaptive: bool = setting(
        False, "the window follows congestion, from incast_window_bytes up"
    )
    incast_order: str = setting(
        "edf", "order delayed requests-to-send are granted in", INCAST_ORDERS
    )
    link_gbit: float = setting(1.0, "the host's link rate: B in EDF's start-by deadline")


@dataclass
class ServeConfig:
    """`cleave serve`'s TOML (docs/serving.md, "Config file"): the top level and its tables."""

    name: str = setting("", 'model name in the URLs; "": the bundle directory\'s name')
    host: str = setting("127.0.0.1", "client address")
    http_port: int = setting(0, "client port; 0: ephemeral (the ready line says which)")
    grpc_port: int | None = setting(
        None, "KServe v2 gRPC port; unset: no gRPC; 0: ephemeral (the router logs it)"
    )
    shards: int = setting(1, "embedding shard processes")
    table_layout: str = setting(
        "rows",
        "how shards split the tables: each into row ranges, or whole tables by size and lookups",
        TABLE_LAYOUTS,
    )
    rankers: int = setting(1, "ranker processes")
    monolithic: bool = setting(False, "serve the whole model in the ranker, no shards")
    router_held: bool = setting(
        False, "the router looks rows up in-process (every table in its memory), no shards"
    )
    # shm by default: co-located roles are what a one-machine deployment has, and shm measured
    # faster than Unix sockets there (docs/benchmarks.md, "Pass-by-reference between
    # co-located roles"). A plan over several hosts uses tcp.
    transport: str = setting(
        "shm",
        "internal sockets: Unix (co-located), shm (co-located, payloads by reference), TCP or "
        "MPTCP (TCP over every NIC)",
        TRANSPORTS,
    )
    fail_stop: bool = setting(False, "a child that dies stops the deployment (default: restart it)")
    table_memory_budget: int = setting(
        0,
        "model repository: bytes every version's shards may hold together (0: this machine's "
        "memory); a load beyond it is refused (docs/repository.md)",
    )
    ready_timeout_s: float = setting(120.0, "start-up budget per group of children")
    stop_timeout_s: float = setting(10.0, "SIGTERM -> SIGKILL grace per child")
    router: RouterConfig = field(default_factory=RouterConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    ranker: RankerConfig = field(default_factory=RankerConfig)

    def check(self) -> ServeConfig:
        def need(ok: bool, key: str, expected: str, value) -> None:
            if not ok:
                raise UsageError(f"config {key}: expected {expected}, got {value!r}")

        need(self.shards >= 1, "shards", "at least 1", self.shards)
        need(self.rankers >= 1, "rankers", "at least 1", self.rankers)
        if self.monolithic:  # the baseline is one process: one ranker loop beside the router
            need(self.rankers == 1, "rankers", "1 with monolithic", self.rankers)
            need(not self.router_held, "router_held", "false with monolithic", True)
        need(
            self.monolithic or not self.ranker.eager_model,
            "ranker.eager_model",
            '"" without monolithic (the eager baseline is a monolithic deployment)',
            self.ranker.eager_model,
        )
        need(0 <= self.http_port < 65536, "http_port", "a port in 0..65535", self.http_port)
        grpc = self.grpc_port
        need(grpc is None or 0 <= grpc < 65536, "grpc_port", "a port in 0..65535", grpc)
        for obj, where in (
            (self, ""),
            (self.router, "router."),
            (self.ranker, "ranker."),
            (self.shard, "shard."),
        ):
            problems = choice_problems(obj, where)
            if problems:
                raise UsageError(f"config {problems[0]}")
        need(self.ranker.max_batch >= 1, "ranker.max_batch", "at least 1", self.ranker.max_batch)
        need(self.ranker.max_wait_ms >= 0, "ranker.max_wait_ms", ">= 0", self.ranker.max_wait_ms)
        need(self.ranker.max_queue >= 1, "ranker.max_queue", "at least 1", self.ranker.max_queue)
        need(self.ranker.threads >= 0, "ranker.threads", ">= 0", self.ranker.threads)
        need(self.shard.threads >= 1, "shard.threads", "at least 1", self.shard.threads)
        need(
            self.table_memory_budget >= 0,
            "table_memory_budget",
            ">= 0 bytes",
            self.table_memory_budget,
        )
        need(
            self.shard.dram_budget == 0 or self.shard.dram_budget >= 1 << 20,
            "shard.dram_budget",
            "0 (all in DRAM) or at least 1048576 bytes (1 MiB)",
            self.shard.dram_budget,
        )
        r = self.router
        need(
            0 < r.budget_ms <= r.max_budget_ms,
            "router.budget_ms",
            "in (0, max_budget_ms]",
            r.budget_ms,
        )
        need(r.body_limit_mb > 0, "router.body_limit_mb", "> 0", r.body_limit_mb)
        need(r.threads >= 1, "router.threads", "at least 1", r.threads)
        need(
            r.ranker_connections >= 1,
            "router.ranker_connections",
            "at least 1",
            r.ranker_connections,
        )
        for key in (
            "header_timeout_ms",
            "idle_timeout_ms",
            "body_min_bytes_per_s",
            "max_connections",
            "max_in_flight",
            "max_retry_after_s",
        ):
            need(getattr(r, key) >= 1, f"router.{key}", "at least 1", getattr(r, key))
        need(r.body_grace_ms >= 0, "router.body_grace_ms", ">= 0", r.body_grace_ms)
        need(0 < r.admit_share <= 1, "router.admit_share", "in (0, 1]", r.admit_share)
        need(r.shard_timeout_ms >= 0, "router.shard_timeout_ms", ">= 0", r.shard_timeout_ms)
        need(r.response_credits >= 0, "router.response_credits", ">= 0 bytes", r.response_credits)
        need(
            r.admin_token_env == "" or _ENV_NAME.fullmatch(r.admin_token_env) is not None,
            "router.admin_token_env",
            "an environment variable's name (letters, digits, _) or empty",
            r.admin_token_env,
        )
        self._check_cache(need)
        need(self.ready_timeout_s > 0, "ready_timeout_s", "> 0", self.ready_timeout_s)
        return self

    def _check_cache(self, need) -> None:
        """The router cache's settings (the router checks them again; docs/cache.md)."""
        r = self.router
        for key in ("cache_bytes", "memory_budget_bytes", "activation_bytes_per_sample"):
            need(getattr(r, key) >= 0, f"router.{key}", ">= 0 bytes", getattr(r, key))
        need(r.cache_window >= 1, "router.cache_window", "at least 1", r.cache_window)
        if r.cache == "off":
            return
        need(
            not (self.monolithic or self.router_held),
            "router.cache",
            '"off" without shard processes (monolithic or router_held): it saves shard lookups',
            r.cache,
        )
        if r.cache == "fixed":
            need(r.cache_bytes > 0, "router.cache_bytes", '> 0 with cache "fixed"', r.cache_bytes)
        if r.cache == "adaptive":
            need(
                r.memory_budget_bytes > 0,
                "router.memory_budget_bytes",
                '> 0 with cache "adaptive" (the memory the cache and the batches share)',
                r.memory_budget_bytes,
            )
        need(
            r.memory_budget_bytes == 0 or r.cache_bytes <= r.memory_budget_bytes,
            "router.cache_bytes",
            f"at most memory_budget_bytes ({r.memory_budget_bytes}): the cache lives in it",
            r.cache_bytes,
        )

    def ranker_threads(self, demand: dict | None = None) -> int:
        """Torch threads per ranker: the config's, else this machine's cores split by the
        bundle's measured demand (manifest dense.demand; docs/serving.md, "Cores")."""
        if self.ranker.threads:
            return self.ranker.threads
        # The cores this process may use (taskset, cgroups' cpusets), not the machine's.
        cores = len(os.sched_getaffinity(0))
        return ranker_cores(cores, self.rankers, self.monolithic, demand)


def ranker_cores(cores: int, rankers: int, monolithic: bool, demand: dict | None) -> int:
    """Torch threads per ranker on a machine of `cores`. One core is always left to the router
    and the shards (and the monolith's router threads): a torch thread that loses its core to
    them stalls every parallel region of the batch (measured: 1.5 ms -> 140 ms). Of the rest,
    rankers get the dense side's share by its measured time per sample against the sparse
    side's (a DCN-like model nearly all, a Criteo-like one less), split evenly among them; the
    monolith, one process doing all the work, gets all of the rest."""
    spare = max(1, cores - 1)
    dense = (demand or {}).get("dense_us_per_sample", 0.0)
    sparse = (demand or {}).get("sparse_us_per_sample", 0.0)
    if monolithic or dense <= 0 or sparse < 0:  # no measurement: an older bundle
        return spare if monolithic else max(1, spare // rankers)
    total = min(spare, max(1, round(spare * dense / (dense + sparse))))
    return max(1, total // rankers)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
