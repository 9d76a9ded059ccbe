"""`cleave stream` against a real Kafka broker (one KRaft node, tests/support/kafka.py) and a
real `cleave serve` deployment (one shard group, two replicas, with state directories;
docs/streaming.md). The tests run in order on one deployment and one topic, each producing a
batch and checking what serves after it commits:

* rows serve once their batch commits, every response reads the whole batch or none of it,
  and malformed records are skipped and counted;
* a broker restart loses nothing;
* a consumer killed after a switch and before its commit applies nothing twice on restart;
* a shard killed mid-stream gets the batch once the launcher has restarted it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import cleave
import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
from cleave.bench.loadgen import infer_body, outputs_of
from cleave.bundle.bundle import Bundle
from cleave.launch.process import ServeProcess
from cleave.models import MODELS, RequestGenerator
from cleave.shard_update import table_status
from cleave.stream import encode_record, record_key
from cleave.stream.consumer import EXIT_BEFORE_COMMIT_ENV
from cleave.update import targets_from_router
from support.client import post
from support.processes import processes_below
from support.updates import updatable_plan
from support.waiting import wait_for

SCALE = 0.002
TOLERANCE = 1e-5
TOPIC, GROUP = "rows", "cleave"
pytestmark = pytest.mark.slow  # a broker and a deployment, restarted


class Env:
    """The deployment, its model's current rows, the topic and the running consumer."""

    def __init__(self, root: Path, kafka):
        from confluent_kafka import Producer

        self.root, self.kafka = root, kafka
        model, example = MODELS["dlrm"].factory(scale=SCALE, seed=0)
        self.bundle = cleave.partition(model.eval(), example)
        self.dir = self.bundle.save(root / "dlrm")
        self.manifest = json.loads((self.dir / "manifest.json").read_text())
        self.tables = {t["name"]: t for t in self.manifest["tables"]}
        self.rows = {
            n: np.fromfile(self.dir / t["file"], np.uint8).reshape(t["rows"], t["row_bytes"])
            for n, t in self.tables.items()
        }
        generator = RequestGenerator("dlrm", scale=SCALE, seed=7, min_pooling=1)
        self.requests = [generator.batch(b) for b in (1, 8)]
        self.bodies = [infer_body(self.bundle.named_inputs(*a)) for a in self.requests]
        self.plan, plan = updatable_plan(self.dir, root / "plan.yaml", shards=1, replicas=2)
        self.name = plan.name
        self.producer = Producer({"bootstrap.servers": kafka.bootstrap, "linger.ms": 5})
        self.end = 0  # the topic's next offset
        self.server: ServeProcess | None = None
        self.consumer: subprocess.Popen | None = None
        self.log = root / "stream.log"

    @property
    def url(self) -> str:
        return f"{self.server.url}/v2/models/{self.name}/infer"

    def expected(self) -> list[list[np.ndarray]]:
        """Each request's scores from the model with the rows produced so far."""
        bundle = Bundle(self.manifest, self.rows, self.bundle.dense_program)
        with torch.inference_mode():
            return [
                [t.double().numpy() for t in pytree.tree_leaves(bundle.reference(*a))]
                for a in self.requests
            ]

    def scores(self) -> list[list[np.ndarray]]:
        out = []
        for body in self.bodies:
            status, reply = post(self.url, body)
            assert status == 200, reply
            out.append(outputs_of(reply))
        return out

    def produce(self, values: list[tuple[bytes, bytes]]) -> None:
        """Sends (key, value) records and waits until the broker has them all."""
        for key, value in values:
            self.producer.produce(TOPIC, value=value, key=key)
        left = self.producer.flush(60)
        assert left == 0, f"{left} records not delivered"
        self.end += len(values)

    def update(self, table: str, ids) -> tuple[bytes, bytes]:
        """A record of new rows for `ids` of `table` (random floats), applied to self.rows."""
        meta = self.tables[table]
        rng = np.random.default_rng(self.end + len(ids))
        rows = rng.standard_normal((len(ids), meta["dim"])).astype(np.float32)
        self.rows[table][np.asarray(ids)] = rows.view(np.uint8)
        return record_key(self.name, table), encode_record(self.name, meta, ids, rows)

    def start_consumer(self, **env: str) -> None:
        self.consumer = subprocess.Popen(
            [sys.executable, "-m", "cleave.cli", "stream", "--plan", str(self.plan)]
            + ["--router", self.server.url, "--bootstrap", self.kafka.bootstrap]
            + ["--topic", TOPIC, "--group", GROUP, "--instance", "test", "--batch-ms", "300"]
            + ["--switch-margin-ms", "500", "--timeout", "5", "--metrics", "127.0.0.1:0"],
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("a"),
            env={**os.environ, **env},
        )
        mark = self.log.stat().st_size if self.log.exists() else 0
        wait_for(lambda: "assigned partitions [0]" in self.log_since(mark), "the assignment", 60)
        self.metrics_url = self.log_since(mark).split("metrics on ")[1].split()[0]

    def log_since(self, mark: int) -> str:
        with self.log.open() as f:
            f.seek(mark)
            return f.read()

    def stop_consumer(self) -> None:
        if self.consumer and self.consumer.poll() is None:
            self.consumer.send_signal(signal.SIGTERM)
            assert self.consumer.wait(30) == 0, self.log.read_text()[-3000:]

    def committed(self) -> int:
        from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException, TopicPartition
        from confluent_kafka.admin import AdminClient

        # A client per call: with one client kept across the broker restart, this never saw
        # the commit that the consumer logged.
        admin = AdminClient({"bootstrap.servers": self.kafka.bootstrap, "log_level": 4})
        request = ConsumerGroupTopicPartitions(GROUP, [TopicPartition(TOPIC, 0)])
        try:
            found = admin.list_consumer_group_offsets([request])[GROUP].result(timeout=10)
        except KafkaException:  # the broker restarting
            return -1
        return found.topic_partitions[0].offset

    def wait_committed(self) -> None:
        wait_for(lambda: self.committed() == self.end, f"offset {self.end} committed", 90)

    def counter(self, outcome: str) -> float:
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(f'cleave_stream_records_total{{outcome="{outcome}"}}'):
                return float(line.split()[-1])
        return 0.0

    def versions(self, table: str) -> dict[str, tuple[int, dict]]:
        """Each replica's committed version of `table` and the offsets its source names."""
        out = {}
        for t in targets_from_router(self.server.url, table, None):
            status = table_status(t.addr, table)
            out[t.addr] = (status["version"], (status.get("source") or {}).get("offsets"))
        return out


def shard_pid(server: ServeProcess, name: str) -> int | None:
    found = [
        p for p, argv in processes_below(server.proc.pid).items() if any(name in a for a in argv)
    ]
    return found[0] if found else None


def close(got: list[list[np.ndarray]], want: list[list[np.ndarray]]) -> bool:
    return all(
        g.shape == w.shape and np.abs(g - w).max() <= TOLERANCE
        for gs, ws in zip(got, want, strict=True)
        for g, w in zip(gs, ws, strict=True)
    )


@pytest.fixture(scope="module")
def env(kafka, tmp_path_factory):
    env = Env(tmp_path_factory.mktemp("stream"), kafka)
    kafka.create_topic(TOPIC)
    with ServeProcess(None, "--plan", str(env.plan)) as server:
        env.server = server
        env.start_consumer()
        yield env
        env.stop_consumer()
    env.producer = None  # its client closes before the broker stops


def test_rows_serve_once_their_batch_commits_whole_and_malformed_records_are_skipped(env):
    big, other = sorted(env.tables, key=lambda n: -env.tables[n]["rows"])[:2]
    old = env.expected()
    assert close(env.scores(), old)
    rows = env.tables[big]["rows"]
    records = [  # every row of both tables, in records of at most 4096 rows
        env.update(t, ids)
        for t in (big, other)
        for ids in np.array_split(np.arange(env.tables[t]["rows"]), -(-rows // 4096))
    ]
    new = env.expected()
    assert not close(new, old)
    key, dim = record_key(env.name, big), env.tables[big]["dim"]
    one = np.ones((1, dim))
    wrong_dim = {**env.tables[big], "dim": env.tables[big]["dim"] + 1}
    wrong_dim["row_bytes"] = 4 * wrong_dim["dim"]
    malformed = [
        (key, b"garbage"),
        (key, encode_record(env.name, {**env.tables[big], "name": "no"}, [0], one)),
        (key, encode_record(env.name, wrong_dim, [0], np.ones((1, dim + 1)))),
        (key, encode_record(env.name, {**env.tables[big], "rows": rows + 1}, [rows], one)),
    ]
    seen, stop = [], threading.Event()

    def load():  # responses while the batch is applied: old whole, then new whole
        while not stop.is_set():
            for i, body in enumerate(env.bodies):
                status, reply = post(env.url, body)
                seen.append((i, outputs_of(reply) if status == 200 else None))

    thread = threading.Thread(target=load)
    thread.start()
    try:
        env.produce([records[0], *malformed[:2], *records[1:-1], *malformed[2:], records[-1]])
        env.wait_committed()
    finally:
        stop.set()
        thread.join()
    assert close(env.scores(), new)
    kinds = [
        "failed" if s is None
        else "old" if close([s], [old[i]])
        else "new" if close([s], [new[i]])
        else "mixed"
        for i, s in seen
    ]  # fmt: skip
    assert not {"failed", "mixed"} & set(kinds) and kinds == sorted(kinds, reverse=True), kinds
    assert env.counter("malformed") == 4 and env.counter("applied") == len(records)
    for table in (big, other):  # each replica: version 1, with its table's last offset
        versions = list(env.versions(table).values())
        assert len(versions) == 2 and versions[0] == versions[1] and versions[0][0] == 1
    assert versions[0][1] == {"0": env.end - 1}  # the last record, of `other`


def test_a_broker_restart_loses_nothing(env):
    table = max(env.tables, key=lambda n: env.tables[n]["rows"])
    before = next(iter(env.versions(table).values()))[0]
    env.produce([env.update(table, [0, 1, 2])])
    env.kafka.stop()
    pending = env.update(table, [3, 4])
    env.producer.produce(TOPIC, value=pending[1], key=pending[0])  # held until it returns
    env.kafka.start()
    assert env.producer.flush(60) == 0
    env.end += 1
    env.wait_committed()
    assert close(env.scores(), env.expected())
    for version, offsets in env.versions(table).values():
        assert before < version <= before + 2 and offsets == {"0": env.end - 1}


def test_a_consumer_killed_between_switch_and_commit_applies_the_batch_once(env):
    table = max(env.tables, key=lambda n: env.tables[n]["rows"])
    env.stop_consumer()
    committed = env.committed()
    before = {a: v for a, (v, _) in env.versions(table).items()}
    env.start_consumer(**{EXIT_BEFORE_COMMIT_ENV: "1"})
    env.produce([env.update(table, [5, 6, 7])])
    assert env.consumer.wait(60) == 3  # it exited after the switch, before the commit
    assert env.committed() == committed
    after = {a: v for a, (v, _) in env.versions(table).items()}
    assert after == {a: v + 1 for a, v in before.items()}
    assert close(env.scores(), env.expected())
    env.start_consumer()
    env.wait_committed()
    assert env.counter("duplicate") == 1 and env.counter("applied") == 0
    assert {a: v for a, (v, _) in env.versions(table).items()} == after  # not applied again
    assert close(env.scores(), env.expected())


def test_a_shard_killed_mid_stream_gets_the_batch_after_its_restart(env):
    table = max(env.tables, key=lambda n: env.tables[n]["rows"])
    before = {a: v for a, (v, _) in env.versions(table).items()}
    shard = shard_pid(env.server, "shard-0-0")
    mark = env.log.stat().st_size
    os.kill(shard, signal.SIGSTOP)  # hangs: the batch's steps to it time out (--timeout 5)
    env.produce([env.update(table, [8, 9])])
    wait_for(lambda: "batch not applied, again in" in env.log_since(mark), "a retry", 60)
    os.kill(shard, signal.SIGKILL)  # the launcher restarts it; the batch is sent again
    env.wait_committed()
    assert shard_pid(env.server, "shard-0-0") not in (None, shard)  # restarted meanwhile
    versions = env.versions(table)
    assert {a: v for a, (v, _) in versions.items()} == {a: v + 1 for a, v in before.items()}
    assert {json.dumps(o) for _, o in versions.values()} == {json.dumps({"0": env.end - 1})}
    assert close(env.scores(), env.expected())
