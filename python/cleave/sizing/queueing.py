"""The latency model of a pool of identical servers (docs/sizing.md, "The model"): requests
arrive at rate `rate` (Poisson), each takes `service_s` of one of `servers` servers. Waiting
follows M/M/c (Erlang C): P(wait > t) = C(c, a) * exp(-(c*mu - lambda) * t), so the 99th
percentile of the wait is ln(C / 0.01) / (c*mu - lambda) when C > 0.01, else 0. A request's
p99 is its service time plus that wait: exponential service would be worse, deterministic
better; batching in the rankers is left out, which overstates their wait."""

from __future__ import annotations

import functools
import math

QUANTILE = 0.99


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits, for `offered` = lambda / mu Erlangs on `servers`
    servers (1.0 when the pool is saturated). Erlang B by its stable recurrence, then C."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    return servers * b / (servers - offered * (1 - b))


# The search asks for the same pools' tails again and again (a mix grows one pool at a time).
@functools.lru_cache(maxsize=1 << 16)
def p99_s(servers: int, service_s: float, rate: float, quantile: float = QUANTILE) -> float:
    """The pool's `quantile` time in system (the 99th percentile by default); inf when it
    cannot keep up."""
    if rate <= 0:
        return service_s
    mu = 1.0 / service_s
    if rate >= servers * mu:
        return math.inf
    waits = erlang_c(servers, rate / mu)
    tail = 1.0 - quantile
    wait = math.log(waits / tail) / (servers * mu - rate) if waits > tail else 0.0
    return service_s + wait


def utilization(servers: int, service_s: float, rate: float) -> float:
    return rate * service_s / servers
