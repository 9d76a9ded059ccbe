"""Role addresses, one home for every transport's form (choices.TRANSPORTS): `host:port`
(tcp), `mptcp:host:port`, `unix:/path` and `shm:/path`. The runners choose addresses with
these; the roles read their --listen with them. The Rust side parses the same forms
(crates/cleave-wire/src/addr.rs)."""

from __future__ import annotations

from pathlib import Path

# The transports whose roles must all share one host: their addresses are socket paths
# (`shm:` is a Unix socket too; its data connections pass payloads through shared memory).
LOCAL_TRANSPORTS = ("unix", "shm")
# The prefixes of socket-path addresses, one per local transport.
_PATH_PREFIXES = tuple(f"{t}:" for t in LOCAL_TRANSPORTS)


def is_local_address(address: str) -> bool:
    """Whether a listen address is a socket path (`unix:` or `shm:`), served on loopback."""
    return address.startswith(_PATH_PREFIXES)


def socket_path(address: str) -> Path | None:
    """The socket path of a `unix:` or `shm:` address; None for a TCP or MPTCP one."""
    if not is_local_address(address):
        return None
    return Path(address.split(":", 1)[1])


def listen_host(listen: str) -> str:
    """The host of a --listen address of any transport (loopback for a socket path), without
    brackets: where the role's probes and control port listen."""
    if is_local_address(listen):
        return "127.0.0.1"
    return listen.removeprefix("mptcp:").rsplit(":", 1)[0].strip("[]")


def listen_address(transport: str, host: str, port: int) -> str:
    """A TCP role's --listen address under `transport` (tcp or mptcp)."""
    return f"{'mptcp:' if transport == 'mptcp' else ''}{host}:{port}"


def path_address(transport: str, path: Path) -> str:
    """A co-located role's --listen address under a local transport (unix or shm)."""
    if transport not in LOCAL_TRANSPORTS:
        raise ValueError(f"transport {transport!r} has no socket-path address")
    return f"{transport}:{path}"
