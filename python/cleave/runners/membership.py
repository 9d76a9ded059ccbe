"""A client of a router's membership admin API (docs/serving.md, "Replicas and membership"):
list the shard replicas and rankers, add a shard replica, drain or remove a member while the
router serves. Runners that scale a deployment (Ray, Kubernetes) use it.

`url` is the router's base URL (`http://HOST:PORT`). With `token` (the value of the variable
the router's `admin_token_env` names) every call carries `Authorization: Bearer <token>`.
A refused call raises `MembershipError` with the router's status and message."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from cleave.errors import CleaveError

KINDS = ("shards", "rankers")


class MembershipError(CleaveError):
    """The router refused an admin call (or could not be reached): says which and why."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def members(url: str, token: str | None = None, timeout: float = 10.0) -> dict:
    """`{"shards": [{addr, ranges, state, outstanding, ewma_ms}], "rankers": [...]}`."""
    return _call(url, "GET", "members", None, token, timeout)


def add_shard(
    url: str, addr: str, ranges: list[dict], token: str | None = None, timeout: float = 10.0
) -> dict:
    """Adds the shard at `addr` as a replica; `ranges` (`{table, row_start, row_end}` each)
    must equal the ranges of an existing replica group. Returns the membership after."""
    return _call(url, "POST", "shards", {"addr": addr, "ranges": ranges}, token, timeout)


def add_ranker(
    url: str,
    addr: str,
    token: str | None = None,
    timeout: float = 10.0,
    control: str | None = None,
) -> dict:
    """Adds the ranker at `addr`; `control`: its incast control port's HOST:PORT, required
    when the router has incast control on, refused when off. Returns the membership after."""
    body = {"addr": addr} if control is None else {"addr": addr, "control": control}
    return _call(url, "POST", "rankers", body, token, timeout)


def drain(url: str, kind: str, addr: str, token: str | None = None, timeout: float = 10.0) -> dict:
    """Sends no new work to the member (`kind` "shards" or "rankers") at `addr`; work in
    flight finishes. Returns the membership after."""
    return _call(url, "POST", f"{_kind(kind)}/drain", {"addr": addr}, token, timeout)


def remove(url: str, kind: str, addr: str, token: str | None = None, timeout: float = 10.0) -> dict:
    """Removes the member (`kind` "shards" or "rankers") at `addr`. Returns the membership
    after."""
    return _call(url, "POST", f"{_kind(kind)}/remove", {"addr": addr}, token, timeout)


def cache_switch(
    url: str, table: str, switch_at_us: int, token: str | None = None, timeout: float = 10.0
) -> dict:
    """Tells the router that `table` switches to a new version at `switch_at_us` (Unix µs), so
    that its cache keys requests as of then anew (docs/cache.md); a no-op with the cache off."""
    body = {"table": table, "switch_at_unix_us": switch_at_us}
    return _call(url, "POST", "cache/switch", body, token, timeout)


def cache_stats(url: str, token: str | None = None, timeout: float = 10.0) -> dict:
    """The router cache's counters and sizes (`{"mode": "off"}` when it has none)."""
    return _call(url, "GET", "cache", None, token, timeout)


def _kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return kind


def _call(url: str, method: str, path: str, body, token: str | None, timeout: float) -> dict:
    target = f"{url.rstrip('/')}/admin/v1/{path}"
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(target, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        text = err.read().decode(errors="replace")
        try:
            message = json.loads(text)["error"]
        except (ValueError, KeyError, TypeError):
            message = text
        raise MembershipError(f"{method} {target}: {err.code}: {message}", err.code) from None
    except (urllib.error.URLError, OSError) as err:
        raise MembershipError(f"{method} {target}: cannot reach the router: {err}") from None
