"""Admits the rankers an autoscaler adds to a router, and removes those it took away.

Runs beside each router (a sidecar of the router pod, in the ranker image, which has the
cleave package) when the chart's ranker autoscaling is on (docs/deploy.md, "Scaling"). The
router knows the plan's rankers from its JSON; ranker pods with higher ordinals exist only
while the HPA wants them. Every INTERVAL_S this compares the router's rankers with the ranker
pods whose DNS names resolve (the headless Service publishes not-ready pods too) and, through
the router's admin API, adds the new ones and drains and removes the gone ones. Rankers of
the plan are never touched. A router that restarted forgets what was added: the next round
adds it again.

Environment: ROUTER_URL (http://127.0.0.1:PORT), RANKER_HOST (a format with {i}: the
ordinal's DNS name), RANKER_PORT, PLANNED (the plan's ranker count), MAX_RANKERS (the HPA's
maximum), INTERVAL_S, and ADMIN_TOKEN_ENV (the name of the variable holding the admin token,
or empty)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading

from cleave.runners import membership

log = logging.getLogger("cleave.members")


def wanted(host_format: str, port: int, planned: int, most: int, resolves) -> set[str]:
    """The addresses of the ranker pods beyond the plan's that exist now."""
    hosts = (host_format.format(i=i) for i in range(planned, most))
    return {f"{h}:{port}" for h in hosts if resolves(h)}


def managed(host_format: str, port: int, planned: int, most: int) -> set[str]:
    """Every address this may add or remove: never one of the plan's rankers."""
    return {f"{host_format.format(i=i)}:{port}" for i in range(planned, most)}


def reconcile(current: set[str], want: set[str], mine: set[str]) -> tuple[list, list]:
    """(addresses to add, addresses to drain and remove)."""
    return sorted(want - current), sorted((current & mine) - want)


def resolves(host: str) -> bool:
    try:
        return bool(socket.getaddrinfo(host, None))
    except OSError:
        return False


def one_round(env: dict, token: str | None) -> None:
    url, port = env["ROUTER_URL"], int(env["RANKER_PORT"])
    planned, most = int(env["PLANNED"]), int(env["MAX_RANKERS"])
    host = env["RANKER_HOST"]
    current = {r["addr"] for r in membership.members(url, token)["rankers"]}
    add, gone = reconcile(
        current,
        wanted(host, port, planned, most, resolves),
        managed(host, port, planned, most),
    )
    for addr in add:
        membership.add_ranker(url, addr, token)
        log.info("admitted ranker %s", addr)
    for addr in gone:
        membership.drain(url, "rankers", addr, token)
        membership.remove(url, "rankers", addr, token)
        log.info("removed ranker %s (its pod is gone)", addr)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    env = os.environ
    token_env = env.get("ADMIN_TOKEN_ENV", "")
    token = env.get(token_env) if token_env else None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    interval = float(env.get("INTERVAL_S", "5"))
    while not stop.is_set():  # until the pod stops; each round's calls have timeouts
        try:
            one_round(env, token)
        except (membership.MembershipError, OSError, ValueError, KeyError) as err:
            log.warning("membership round failed, retrying in %.0f s: %s", interval, err)
        stop.wait(interval)


if __name__ == "__main__":
    main()
