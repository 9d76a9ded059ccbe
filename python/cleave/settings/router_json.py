"""`router_config`: the JSON a router reads (crates/cleave-router's config; docs/serving.md).
The router process is the `cleave-router CONFIG.json` executable (no Python in it).

Every RouterConfig setting is written under its own name, so a new router setting needs no
change here; the exceptions are below."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cleave.settings import RouterConfig, ServeConfig

# Settings the launchers use and the router never reads (docs/security.md: the secret is
# shared through the environment).
LAUNCHER_ONLY = ("internal_secret_env",)
# Written only when set: the chart's config has none of them (credits off, no TLS, no tokens).
WHEN_SET = ("response_credits", "auth_token_file", "tls_cert", "tls_key")
_PATHS = ("auth_token_file", "tls_cert", "tls_key")
# Written under another name or form: the setting -> the router's key.
CONVERTED = {"body_limit_mb": "body_limit_bytes", "admin_token_env": "admin_token_env"}


def router_settings(r: RouterConfig) -> dict:
    """The router's JSON keys for its settings (the part of `router_config` from `r`)."""
    values = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
    for key in LAUNCHER_ONLY:
        del values[key]
    values["body_limit_bytes"] = int(values.pop("body_limit_mb") * (1 << 20))
    # The variable's name only: the router reads the token from its environment.
    values["admin_token_env"] = r.admin_token_env or None
    for key in WHEN_SET:
        if not values[key]:
            del values[key]
        elif key in _PATHS:  # paths only (docs/security.md)
            values[key] = str(Path(values[key]).resolve())
    return values


def router_config(
    name: str,
    bundle: Path,
    config: ServeConfig,
    routes: list[dict],
    rankers: list[str],
) -> dict:
    return {
        "model": name,
        "bundle": str(bundle),
        "host": config.host,
        "http_port": config.http_port,
        "mode": deployment_mode(config),
        "shards": routes,
        "rankers": rankers,
        "ready_timeout_ms": int(config.ready_timeout_s * 1000),
        **router_settings(config.router),
        # Router-held mode only (the chart renders no such deployment).
        **({"held_threads": config.shard.threads} if config.router_held else {}),
        # Only when asked for: a router config without it serves no gRPC (the chart's too).
        **({} if config.grpc_port is None else {"grpc_port": config.grpc_port}),
    }


def deployment_mode(config: ServeConfig) -> str:
    """The deployment's mode, as plans and the router's config name it."""
    if config.monolithic:
        return "monolithic"
    return "router-held" if config.router_held else "disaggregated"
