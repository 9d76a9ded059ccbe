"""The `cleave serve` configuration: a TOML file (docs/serving.md, "Config file"), overridden
by command-line flags. Every key is checked: an unknown key or a wrong type is an error that
names the file, the key, what was expected and what arrived."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from cleave.errors import UsageError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


# Queue policies of shards and rankers (cleave_wire::queue, cleave/ranker/queues/).
QUEUE_POLICIES = ("fifo", "edf")


@dataclass
class RouterConfig:
    budget_ms: float = 1000.0  # latency budget of a request that names none
    max_budget_ms: float = 60000.0  # the largest budget a request may ask for
    body_limit_mb: float = 64.0  # larger request bodies get 413
    connect_timeout_ms: int = 1000  # connecting to a shard or ranker
    health_interval_ms: int = 1000  # how often backends are probed for readiness
    ranker_connections: int = 2  # connections kept to each ranker
    threads: int = 2  # router I/O threads (HTTP and backends)
    header_timeout_ms: int = 10000  # a started request head must arrive whole within this
    idle_timeout_ms: int = 60000  # a connection with no request in progress closes after this
    body_min_bytes_per_s: int = 16384  # slower bodies get 408 (after body_grace_ms)
    body_grace_ms: int = 2000  # how long a body may take before its rate is held to the minimum
    max_connections: int = 16384  # open client connections; more are refused with 503
    max_in_flight: int = 2048  # requests in progress; more are shed with 503
    shed: bool = True  # shed at once (503) when the expected latency exceeds the budget
    admit_share: float = 0.5  # the share of its budget a request's estimate may fill
    # The environment variable holding the admin API's bearer token (docs/serving.md,
    # "Replicas and membership"); "": the admin API needs no token. Never the token itself.
    admin_token_env: str = ""
    # Longest wait for one shard replica; a slower one is retried once on another replica
    # within the budget. 0: half of what is left of the budget. A range's only replica
    # (or the retry) may always use the rest of the budget.
    shard_timeout_ms: int = 0
    # Response credits (docs/protocol.md, "Response credits"): each shard data connection's
    # initial window in bytes, at least the largest shard response. 0: off.
    response_credits: int = 0
    # docs/security.md. A file holding the bearer token clients must send on REST and gRPC
    # ("": none); TLS on both client ports from a PEM certificate chain and key ("": plain).
    auth_token_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    # The environment variable holding the deployment's internal secret: every shard, ranker
    # and router connection then proves it in its HELLO (docs/security.md). Never the secret.
    internal_secret_env: str = ""


@dataclass
class ShardConfig:
    threads: int = 1  # lookup threads per shard
    queue: str = "fifo"  # order received lookups start in: fifo | edf (docs/serving.md)
    # Bytes of DRAM per shard for its rows; tables larger than it are served from SSD behind
    # DRAM caches of this size (docs/tiers.md). 0: all in DRAM.
    dram_budget: int = 0


@dataclass
class RankerConfig:
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 0  # torch CPU threads per ranker; 0: (cores - 1) / rankers, at least 1
    max_batch: int = 256  # rows per batch at most
    max_wait_ms: float = 0.0  # how long a request may wait for company; 0: work-conserving
    max_queue: int = 1024  # requests waiting at most; more are refused `overloaded` at once
    queue: str = "fifo"  # order waiting requests start in: fifo | edf (docs/serving.md)
    cuda_graphs: bool = True
    compile: bool = False  # compile the dense program with TorchInductor before ready (CPU)
    compile_cache: str = ""  # compiled programs kept here; "": $XDG_CACHE_HOME/cleave/inductor
    shared_batching: bool = True  # join requests of a shared-input model (bundle permitting)


@dataclass
class ServeConfig:
    name: str = ""  # model name in the URLs; "" -> the bundle directory's name
    host: str = "127.0.0.1"
    http_port: int = 0  # 0: an ephemeral port (the ready line says which)
    grpc_port: int | None = None  # KServe v2 gRPC; None: off; 0: ephemeral (the router logs it)
    shards: int = 1
    rankers: int = 1
    monolithic: bool = False
    # The router looks rows up in-process (every table in its memory), no shard processes:
    # Prism's CN keeping its tables local. Lookup threads: [shard] threads.
    router_held: bool = False
    transport: str = "unix"  # internal sockets: "unix" (co-located) or "tcp" on loopback
    fail_stop: bool = False  # a child that dies stops the deployment (default: restart it)
    ready_timeout_s: float = 120.0
    stop_timeout_s: float = 10.0
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
        need(0 <= self.http_port < 65536, "http_port", "a port in 0..65535", self.http_port)
        grpc = self.grpc_port
        need(grpc is None or 0 <= grpc < 65536, "grpc_port", "a port in 0..65535", grpc)
        need(self.transport in ("unix", "tcp"), "transport", '"unix" or "tcp"', self.transport)
        need(
            self.ranker.device in ("auto", "cpu", "cuda"),
            "ranker.device",
            '"auto", "cpu" or "cuda"',
            self.ranker.device,
        )
        need(self.ranker.max_batch >= 1, "ranker.max_batch", "at least 1", self.ranker.max_batch)
        need(self.ranker.max_wait_ms >= 0, "ranker.max_wait_ms", ">= 0", self.ranker.max_wait_ms)
        need(self.ranker.max_queue >= 1, "ranker.max_queue", "at least 1", self.ranker.max_queue)
        need(self.ranker.threads >= 0, "ranker.threads", ">= 0", self.ranker.threads)
        for role in ("shard", "ranker"):
            policy = getattr(self, role).queue
            need(policy in QUEUE_POLICIES, f"{role}.queue", '"fifo" or "edf"', policy)
        need(self.shard.threads >= 1, "shard.threads", "at least 1", self.shard.threads)
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
        need(self.ready_timeout_s > 0, "ready_timeout_s", "> 0", self.ready_timeout_s)
        return self

    def ranker_threads(self, demand: dict | None = None) -> int:
        """Torch threads per ranker: the config's, else this machine's cores split by the
        bundle's measured demand (manifest dense.demand; docs/serving.md, "Cores")."""
        if self.ranker.threads:
            return self.ranker.threads
        return ranker_cores(os.cpu_count() or 1, self.rankers, self.monolithic, demand)


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

_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


# Keys that older versions took, with what replaced them.
_REPLACED = {
    "restart": "restarts are the default now; set fail_stop = true to stop the deployment "
    "when a child dies instead",
}


def _fill(obj, table: dict, where: str, path: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in table.items():
        name = f"{where}{key}"
        if name in _REPLACED:
            raise UsageError(f"{path}: key {name!r} was removed: {_REPLACED[name]}")
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise UsageError(f"{path}: unknown key {name!r}; known keys here: {known}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise UsageError(f"{path}: [{name}] must be a table, got {value!r}")
            _fill(current, value, f"{name}.", path)
            continue
        kind = type(current)
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise UsageError(
                f"{path}: {name} must be {_KINDS[kind]}, got {type(value).__name__} {value!r}"
            )
        setattr(obj, key, value)


def load(path: str | os.PathLike | None) -> ServeConfig:
    """The defaults, overridden by the TOML file at `path` (if any)."""
    config = ServeConfig()
    if path is None:
        return config
    path = Path(path)
    try:
        with path.open("rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"{path}: not valid TOML: {err}") from None
    _fill(config, table, "", str(path))
    return config
