"""Per-stage time of a deployment from its roles' Prometheus metrics, scraped before and after a
load (docs/benchmarks.md, "Across hosts: the testbed", says how each stage is measured).

The router's `cleave_router_stage_seconds{stage}` histogram gives parse, lookup, transfer,
queue, compute and total; each shard's `cleave_shard_request_duration_seconds` gives its own
service time. The sparse side's network is not measured anywhere directly, so it is derived:
`lookup_network` = the router's mean lookup time less the mean service time of the slowest
shard that served (a router's lookup waits for the last shard of its fan-out). What it keeps
is the wire both ways, the shard's socket queueing and the router's own encode and merge; a
mean of maxima is at least the maximum of means, so it leans towards the network.
`transfer` (the ranker's side) is the router's round trip less the ranker's reported queue and
compute (`Ranked::transfer` in crates/cleave-router/src/backend/ranker.rs). The ranker's
queue includes its pickup, a request waiting in its frame server for the Python thread busy
with a batch (`cleave_ranker_pickup_seconds`, mean `pickup`), so `transfer` is the transport's
own: copies, socket, wake-ups. `send_cpu` is the router's CPU per ranker round trip on its send
path (`cleave_router_ranker_send_cpu_seconds_total`: packing the payload and the socket
writes, on shm the write into the slot). On the testbed, the
packets each host link's queue dropped (`tc -s qdisc`, its bfifo) are counted too: drops mean TCP
retransmissions, which no stage shows by name.
"""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

ROUTER_STAGES = ("parse", "lookup", "transfer", "queue", "compute", "total")
SCRAPE_TIMEOUT_S = 5.0

__all__ = [
    "ROUTER_STAGES",
    "breakdown",
    "gauge",
    "metrics_endpoints",
    "printed_all_metrics",
    "scrape",
    "testbed_links",
]


def metrics_endpoints(log_lines, url: str) -> dict[str, str]:
    """Role name -> its /metrics URL: from `cleave serve`'s lines `metrics NAME URL/metrics`
    (one a role, before its `ready` line), else only the router at `url` (a deployment we did
    not start: its shards' metrics ports are unknown here)."""
    found = {}
    for line in log_lines:
        _, sep, rest = line.partition("cleave serve: metrics ")
        words = rest.split()
        if sep and len(words) == 2:
            found[words[0]] = words[1]
    return found or {"router": f"{url.rstrip('/')}/metrics"}


def printed_all_metrics(log_lines) -> bool:
    """Whether `cleave serve` printed the routers' metrics lines: they come last."""
    return any(
        line.startswith(("cleave serve: metrics router", "cleave serve: metrics monolith"))
        for line in log_lines
    )


def testbed_links(log_lines) -> dict[str, tuple[str, str, str]]:
    """Plan host -> (netns, veth, bridge port) of its link, from `cleave serve`'s "testbed
    'NAME': h0=ADDR, …" line; empty when the deployment is not on a testbed."""
    from cleave.testbed.testbed import host_link

    for line in reversed(list(log_lines)):
        _, sep, rest = line.partition("cleave serve: testbed ")
        if sep and ": " in rest:
            pairs = [p.split("=", 1) for p in rest.split(": ", 1)[1].split(", ")]
            return {host: host_link(address) for host, address in pairs}
    return {}


def _bfifo_drops(text: str) -> float:
    """Packets the bfifo leaf dropped, from `tc -s qdisc show` output."""
    lines = text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("qdisc bfifo") and "dropped " in lines[i + 1]:
            return float(lines[i + 1].split("dropped ", 1)[1].split(",", 1)[0])
    return 0.0


def _link_drops(netns: str, veth: str, bridge_port: str) -> dict[str, float]:
    from cleave.testbed.commands import tc

    return {
        "drops.to_host": _bfifo_drops(tc("-s", "qdisc", "show", "dev", bridge_port)),
        "drops.from_host": _bfifo_drops(tc("-n", netns, "-s", "qdisc", "show", "dev", veth)),
    }


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as reply:
        return reply.read().decode()


def gauge(url: str, name: str) -> float | None:
    """One unlabelled sample of the metrics at `url` (None: not exported)."""
    for family in text_string_to_metric_families(_fetch(url)):
        for sample in family.samples:
            if sample.name == name and not sample.labels:
                return sample.value
    return None


def scrape(endpoints: dict[str, str], links: dict | None = None) -> dict[str, dict[str, float]]:
    """Each role's sums and counts: `router.<stage>.sum|count`, `shard.sum|count`,
    `shard.response_bytes`. A role that does not answer is left out (it is down: the
    breakdown then says nothing about it). `links` (testbed_links): each host link's drops,
    as `link:<host>`."""
    from cleave.testbed import TestbedError

    out: dict[str, dict[str, float]] = {}
    for host, link in (links or {}).items():
        try:
            out[f"link:{host}"] = _link_drops(*link)
        except TestbedError:
            continue  # the testbed is gone (the deployment stopped)
    for name, url in endpoints.items():
        try:
            text = _fetch(url)
        except (urllib.error.URLError, OSError, ValueError):
            continue
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("cleave_router_stage_seconds_"):
                    kind = sample.name.rsplit("_", 1)[1]
                    if kind in ("sum", "count"):
                        values[f"router.{sample.labels.get('stage')}.{kind}"] = sample.value
                elif sample.name == "cleave_shard_request_duration_seconds_sum":
                    values["shard.sum"] = sample.value
                elif sample.name == "cleave_shard_request_duration_seconds_count":
                    values["shard.count"] = sample.value
                elif sample.name == "cleave_shard_response_bytes_total":
                    values["shard.response_bytes"] = sample.value
                elif sample.name == "cleave_router_ranker_send_cpu_seconds_total":
                    values["router.send_cpu"] = sample.value
                elif sample.name in _PICKUP:
                    values[f"ranker.pickup.{_PICKUP[sample.name]}"] = sample.value
                elif sample.name in _ADMISSION:  # shed: summed over the reasons
                    key = f"admission.{_ADMISSION[sample.name]}"
                    values[key] = values.get(key, 0.0) + sample.value
                    if "reason" in sample.labels:  # and each reason on its own
                        values[f"shed.{sample.labels['reason']}"] = sample.value
                elif sample.name in _CODEC:  # router CPU per step (parse, encode) and protocol
                    labels = sample.labels
                    key = (
                        f"codec.{labels.get('step')}_{labels.get('protocol')}.{_CODEC[sample.name]}"
                    )
                    values[key] = sample.value
        out[name] = values
    return out


_CODEC = {"cleave_router_codec_cpu_seconds_total": "sum", "cleave_router_codec_total": "count"}
_PICKUP = {"cleave_ranker_pickup_seconds_total": "sum", "cleave_ranker_picked_up_total": "count"}
_ADMISSION = {
    "cleave_router_admitted_total": "admitted",
    "cleave_router_shed_total": "shed",
    "cleave_router_expired_after_admission_total": "expired_after_admission",
}


def admission_counts(before: dict, after: dict) -> dict[str, int]:
    """What every router admitted, shed, and let expire after admitting, between two scrapes."""
    routers = [r for r in after if any(k.startswith("admission.") for k in after[r])]
    return {
        name: int(sum(_delta(before, after, r, f"admission.{name}") for r in routers))
        for name in _ADMISSION.values()
    }


def shed_reasons(before: dict, after: dict) -> dict[str, int]:
    """Requests every router refused between two scrapes, by reason (those with any)."""
    keys = {k for values in after.values() for k in values if k.startswith("shed.")}
    counts = {
        k.removeprefix("shed."): int(sum(_delta(before, after, r, k) for r in after))
        for k in sorted(keys)
    }
    return {reason: n for reason, n in counts.items() if n}


def _delta(before: dict, after: dict, role: str, key: str) -> float:
    return after.get(role, {}).get(key, 0.0) - before.get(role, {}).get(key, 0.0)


def breakdown(before: dict, after: dict) -> dict:
    """Mean microseconds per request of each stage between two scrapes, and what the shards
    sent. Empty stages (nothing counted) are left out."""
    stages: dict[str, float] = {}
    routers = [r for r in after if any(k.startswith("router.") for k in after[r])]
    for stage in ROUTER_STAGES:
        total = sum(_delta(before, after, r, f"router.{stage}.sum") for r in routers)
        count = sum(_delta(before, after, r, f"router.{stage}.count") for r in routers)
        if count > 0:
            stages[f"{stage}_us"] = total / count * 1e6
    service, sent = [], 0.0
    for role, values in after.items():
        count = _delta(before, after, role, "shard.count")
        if "shard.count" in values and count > 0:  # stand-by replicas served nothing
            service.append(_delta(before, after, role, "shard.sum") / count * 1e6)
            sent += _delta(before, after, role, "shard.response_bytes")
    # The rankers' pickup (a request waiting in the frame server for the Python thread): the
    # part of their queue spent there.
    picked = sum(_delta(before, after, r, "ranker.pickup.count") for r in after)
    if picked > 0:
        waited = sum(_delta(before, after, r, "ranker.pickup.sum") for r in after)
        stages["pickup_us"] = waited / picked * 1e6
    result: dict = {"stages_us": stages, "shards_served": len(service)}
    trips = sum(_delta(before, after, r, "router.transfer.count") for r in routers)
    if trips > 0 and any("router.send_cpu" in after[r] for r in routers):
        sent_cpu = sum(_delta(before, after, r, "router.send_cpu") for r in routers)
        result["send_cpu_us"] = sent_cpu / trips * 1e6
    codec = {k.rsplit(".", 1)[0] for r in routers for k in after[r] if k.startswith("codec.")}
    cpu_us = {}
    for key in sorted(codec):
        count = sum(_delta(before, after, r, f"{key}.count") for r in routers)
        if count > 0:
            total = sum(_delta(before, after, r, f"{key}.sum") for r in routers)
            cpu_us[key.removeprefix("codec.")] = total / count * 1e6
    if cpu_us:  # the router's CPU per request in each codec step, µs: parse_json, encode_json..
        result["codec_cpu_us"] = cpu_us
    links = {}
    for role in after:
        if role.startswith("link:"):
            host = role.removeprefix("link:")
            links[host] = {
                k.removeprefix("drops."): _delta(before, after, role, k) for k in after[role]
            }
    if links:
        result["link_drops"] = links
    if service and "lookup_us" in stages:
        stages["lookup_service_us"] = max(service)
        stages["lookup_network_us"] = stages["lookup_us"] - max(service)
        lookups = sum(_delta(before, after, r, "router.lookup.count") for r in routers)
        result["lookup_reply_bytes"] = sent / lookups if lookups else None
    return result
