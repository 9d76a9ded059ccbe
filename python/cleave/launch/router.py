"""`router_config`: the JSON a router reads (crates/cleave-router's config; docs/serving.md).
The router process is the `cleave-router CONFIG.json` executable (no Python in it)."""

from __future__ import annotations

from pathlib import Path

from cleave.launch.config import ServeConfig


def _security(r) -> dict:
    return {"auth_token_file": r.auth_token_file, "tls_cert": r.tls_cert, "tls_key": r.tls_key}


def router_config(
    name: str,
    bundle: Path,
    config: ServeConfig,
    routes: list[dict],
    rankers: list[str],
) -> dict:
    r = config.router
    return {
        "model": name,
        "bundle": str(bundle),
        "host": config.host,
        "http_port": config.http_port,
        "mode": deployment_mode(config),
        "shards": routes,
        "rankers": rankers,
        "budget_ms": r.budget_ms,
        "max_budget_ms": r.max_budget_ms,
        "body_limit_bytes": int(r.body_limit_mb * (1 << 20)),
        "connect_timeout_ms": r.connect_timeout_ms,
        "ready_timeout_ms": int(config.ready_timeout_s * 1000),
        "health_interval_ms": r.health_interval_ms,
        "ranker_connections": r.ranker_connections,
        "threads": r.threads,
        "header_timeout_ms": r.header_timeout_ms,
        "idle_timeout_ms": r.idle_timeout_ms,
        "body_min_bytes_per_s": r.body_min_bytes_per_s,
        "body_grace_ms": r.body_grace_ms,
        "max_connections": r.max_connections,
        "max_in_flight": r.max_in_flight,
        "shed": r.shed,
        "admit_share": r.admit_share,
        # The variable's name only: the router reads the token from its environment.
        "admin_token_env": r.admin_token_env or None,
        "shard_timeout_ms": r.shard_timeout_ms,
        # Only when on: the chart's config has none.
        **({"response_credits": r.response_credits} if r.response_credits else {}),
        # Router-held mode only (the chart renders no such deployment).
        **({"held_threads": config.shard.threads} if config.router_held else {}),
        # Only when asked for: a router config without it serves no gRPC (the chart's too).
        **({} if config.grpc_port is None else {"grpc_port": config.grpc_port}),
        # Paths only, and only when set (docs/security.md): the chart's config has none.
        **{k: str(Path(v).resolve()) for k, v in _security(r).items() if v},
    }


def deployment_mode(config: ServeConfig) -> str:
    """The deployment's mode, as plans and the router's config name it."""
    if config.monolithic:
        return "monolithic"
    return "router-held" if config.router_held else "disaggregated"
