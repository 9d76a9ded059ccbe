"""Shard replicas and membership changes while serving (docs/serving.md, "Replicas and
membership"): one `cleave serve --plan` deployment of the `shared` model with the local runner,
2 range groups x 2 replicas and 2 rankers, on Unix sockets (a restarted role keeps its
address). Under steady load a replica is SIGKILLed: no request fails and the replica is
active again once the supervisor restarted it. Replicas and a ranker are drained, removed and
added back under load with exact scores; malformed admin calls are refused with a message;
and a range left with one replica fails fast naming it while it is down, then recovers."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import pytest
from cleave.launch.process import ServeProcess
from cleave.plan import emulated_hosts, make_plan, save_plan
from cleave.runners import membership
from cleave.runners.membership import MembershipError
from cleave.settings import RankerConfig, ServeConfig
from support.client import failures, post
from support.served import Served, check_scores, infer_url, under_load
from support.waiting import wait_for

pytestmark = [
    pytest.mark.slow,  # replicas killed, drained and added under load
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
]

TOKEN_ENV = "CLEAVE_TEST_REPLICAS_ADMIN_TOKEN"
TOKEN = "replicas-test-token"


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    return Served("shared", tmp_path_factory.mktemp("replicas"))


@pytest.fixture(scope="module")
def server(served, tmp_path_factory):
    config = ServeConfig(ranker=RankerConfig(threads=1, device="cpu"))
    config.router.health_interval_ms = 200
    config.router.admin_token_env = TOKEN_ENV
    plan = make_plan(served.dir, emulated_hosts(4), 2, 2, 2, 1, serve_config=config)
    # One host and Unix sockets: a restarted replica comes back at its address (TCP port 0
    # would give it a new one, which the router could not know).
    h0 = plan.hosts[0]
    plan = dataclasses.replace(
        plan,
        transport="unix",
        hosts=[h0],
        shards=[dataclasses.replace(s, host=h0.name, port=0, metrics_port=0) for s in plan.shards],
        rankers=[
            dataclasses.replace(r, host=h0.name, port=0, metrics_port=0) for r in plan.rankers
        ],
        routers=[dataclasses.replace(r, host=h0.name, http_port=0) for r in plan.routers],
    )
    path = tmp_path_factory.mktemp("plan") / "replicas.yaml"
    save_plan(plan, path)
    os.environ[TOKEN_ENV] = TOKEN
    try:
        with ServeProcess(None, "--plan", str(path), "--http-port", "0") as s:
            yield s
    finally:
        del os.environ[TOKEN_ENV]


def members(server: ServeProcess) -> dict:
    return membership.members(server.url, token=TOKEN)


def member(server: ServeProcess, kind: str, name: str) -> dict:
    """The shard or ranker whose address is `<name>.sock`."""
    (m,) = [m for m in members(server)[kind] if m["addr"].endswith(f"/{name}.sock")]
    return m


def pid_of(server: ServeProcess, name: str) -> int | None:
    """The process listening on `<name>.sock` below the launcher, from /proc."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if any(a.endswith(f"/{name}.sock") for a in args) and str(server.proc.pid) in ancestors(
            int(entry.name)
        ):
            return int(entry.name)
    return None


def ancestors(pid: int) -> list[str]:
    found = []
    for _ in range(16):  # bounded: a launcher's roles are a few levels down at most
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            break
        found.append(str(pid))
    return found


def test_every_replica_is_a_route_and_scores_are_exact(server, served):
    check_scores(server, served)
    m = members(server)
    assert sorted(s["addr"].rsplit("/", 1)[1] for s in m["shards"]) == [
        "shard-0-0.sock",
        "shard-0-1.sock",
        "shard-1-0.sock",
        "shard-1-1.sock",
    ]
    assert {s["state"] for s in m["shards"]} == {"active"}
    assert len(m["rankers"]) == 2
    # Replicas of a group hold the same ranges.
    assert (
        member(server, "shards", "shard-0-0")["ranges"]
        == member(server, "shards", "shard-0-1")["ranges"]
    )


def test_a_killed_replica_costs_no_request_and_is_readmitted(server, served):
    victim = pid_of(server, "shard-1-0")
    assert victim is not None

    def kill() -> None:
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: pid_of(server, "shard-1-0") not in (None, victim),
            "the supervisor to restart shard-1-0",
            30,
        )
        wait_for(
            lambda: member(server, "shards", "shard-1-0")["state"] == "active",
            "the router to readmit shard-1-0",
            30,
        )

    results = under_load(server, served, kill)
    assert not failures(results), failures(results)[:3]


def test_malformed_admin_calls_are_refused_with_a_message(server):
    url = server.url
    with pytest.raises(MembershipError) as err:
        membership.members(url)  # no token
    assert err.value.status == 401 and "Bearer" in str(err.value)
    with pytest.raises(MembershipError) as err:
        membership.members(url, token="wrong")
    assert err.value.status == 401
    cases = [
        (lambda: membership.add_shard(url, "h:1", [], token=TOKEN), 400, "ranges: empty"),
        (
            lambda: membership.add_shard(
                url, "h:1", [{"table": "nope", "row_start": 0, "row_end": 1}], token=TOKEN
            ),
            400,
            "exactly the ranges of one replica group",
        ),
        (
            lambda: membership.add_shard(url, "h:1", [{"table": "t", "row_start": 0}], token=TOKEN),
            400,
            "missing field `row_end`",
        ),
        (lambda: membership.drain(url, "shards", "h:1", token=TOKEN), 404, "not a member"),
        (lambda: membership.add_ranker(url, "not an address", token=TOKEN), 400, "addr"),
    ]
    existing = member(server, "shards", "shard-0-0")
    cases.append(
        (
            lambda: membership.add_shard(url, existing["addr"], existing["ranges"], token=TOKEN),
            409,
            "already a member",
        )
    )
    for call, status, says in cases:
        with pytest.raises(MembershipError) as err:
            call()
        assert err.value.status == status, err.value
        assert says in str(err.value), err.value
    with pytest.raises(ValueError, match="kind must be one of"):
        membership.drain(url, "routers", "h:1", token=TOKEN)
    before = members(server)
    assert {s["state"] for s in before["shards"]} == {"active"}, "nothing changed"
    assert len(before["shards"]) == 4


def test_replicas_and_rankers_drain_leave_and_join_under_load(server, served):
    replica = member(server, "shards", "shard-0-1")
    ranker = member(server, "rankers", "ranker-1")

    def churn() -> None:
        after = membership.drain(server.url, "shards", replica["addr"], token=TOKEN)
        assert {s["addr"]: s["state"] for s in after["shards"]}[replica["addr"]] == "draining"
        membership.remove(server.url, "shards", replica["addr"], token=TOKEN)
        # Its partner is now the last replica of group 0: it cannot leave.
        partner = member(server, "shards", "shard-0-0")
        with pytest.raises(MembershipError) as err:
            membership.remove(server.url, "shards", partner["addr"], token=TOKEN)
        assert err.value.status == 409 and "last active replica" in str(err.value)
        after = membership.add_shard(server.url, replica["addr"], replica["ranges"], token=TOKEN)
        assert {s["addr"]: s["state"] for s in after["shards"]}[replica["addr"]] == "active"
        membership.drain(server.url, "rankers", ranker["addr"], token=TOKEN)
        membership.remove(server.url, "rankers", ranker["addr"], token=TOKEN)
        last = member(server, "rankers", "ranker-0")
        with pytest.raises(MembershipError) as err:
            membership.remove(server.url, "rankers", last["addr"], token=TOKEN)
        assert err.value.status == 409 and "last ranker" in str(err.value)
        after = membership.add_ranker(server.url, ranker["addr"], token=TOKEN)
        assert {r["addr"]: r["state"] for r in after["rankers"]}[ranker["addr"]] == "active"

    results = under_load(server, served, churn)
    assert not failures(results), failures(results)[:3]
    m = members(server)
    assert len(m["shards"]) == 4 and len(m["rankers"]) == 2


def test_a_range_with_one_replica_fails_fast_naming_it_then_recovers(server, served):
    spare = member(server, "shards", "shard-0-1")
    membership.remove(server.url, "shards", spare["addr"], token=TOKEN)
    victim = pid_of(server, "shard-0-0")
    body, _ = served.request(8)
    url = infer_url(server, served)
    os.kill(victim, signal.SIGKILL)
    status, reply = post(url, body)
    # 502/503 naming the shard, not a 504 after waiting out the budget.
    assert status in (502, 503), reply
    assert "shard-0-0.sock" in reply["error"], reply
    status, reply = post(url, body)  # ejected now: refused at once, naming range and replica
    assert status in (502, 503) and "shard-0-0.sock" in reply["error"], reply
    wait_for(lambda: post(url, body)[0] == 200, "requests to succeed again", 60)
    assert member(server, "shards", "shard-0-0")["state"] == "active"
    membership.add_shard(server.url, spare["addr"], spare["ranges"], token=TOKEN)
    check_scores(server, served, batches=(4,))


def test_router_config_names_the_token_variable_never_the_token(tmp_path):
    from cleave.errors import UsageError
    from cleave.settings import config_file
    from cleave.settings.router_json import router_config

    config = ServeConfig()
    written = router_config("m", tmp_path, config, [], ["a:1"])
    assert written["admin_token_env"] is None and written["shard_timeout_ms"] == 0
    config.router.admin_token_env = "CLEAVE_ADMIN_TOKEN"
    config.router.shard_timeout_ms = 40
    written = router_config("m", tmp_path, config.check(), [], ["a:1"])
    assert written["admin_token_env"] == "CLEAVE_ADMIN_TOKEN" and written["shard_timeout_ms"] == 40
    for key, value, says in [
        ("admin_token_env", "not a name", "router.admin_token_env"),
        ("shard_timeout_ms", -1, "router.shard_timeout_ms"),
    ]:
        bad = ServeConfig()
        setattr(bad.router, key, value)
        with pytest.raises(UsageError, match=says):
            bad.check()
    path = tmp_path / "serve.toml"
    path.write_text("[router]\nadmin_token_env = 5\n")
    with pytest.raises(UsageError, match="router.admin_token_env must be a string"):
        config_file.load(path)
