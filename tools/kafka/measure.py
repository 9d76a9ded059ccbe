"""The streaming measurement of docs/streaming.md (not a test): 100,000 row updates through
Kafka into a `cleave serve` deployment (one shard group, two replicas) while it serves at
about half its capacity. Prints what the docs record: the capacity, the load, failed requests,
how long from the last record produced until its batch served (its offset committed), and
whether the final scores equal the model with every update.

    .venv/bin/python tools/kafka/measure.py [--updates 100000] [--scale 0.01] [--pin auto]

With `--pin auto` (the default) the deployment and the consumer run on every core but the
last, the broker, the producer and the load generator on the last (issue 23's layout).

Needs `make tools` (the broker's jars in .tools/kafka/libs) and `make setup`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import cleave  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402
from cleave.bench.loadgen import closed_loop, infer_body, open_loop, outputs_of  # noqa: E402
from cleave.bench.machine import parse_pin, pinned  # noqa: E402
from cleave.bundle.bundle import Bundle  # noqa: E402
from cleave.launch.process import ServeProcess  # noqa: E402
from cleave.models import MODELS, RequestGenerator  # noqa: E402
from cleave.plan.files import load_plan, save_plan  # noqa: E402
from cleave.stream import encode_record, record_key  # noqa: E402
from support.client import post  # noqa: E402
from support.kafka import Broker  # noqa: E402

TOPIC, GROUP = "rows", "measure"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=100_000, help="row updates (records)")
    parser.add_argument("--scale", type=float, default=0.01, help="dlrm's scale")
    parser.add_argument("--rate", type=float, default=10_000, help="records produced a second")
    parser.add_argument("--load-s", type=float, default=30.0, help="seconds of load")
    parser.add_argument(
        "--pin",
        default="auto",
        help="SERVER:CLIENT CPU lists (auto, off): the deployment "
        "and the consumer on SERVER; the broker, producer and load generator on CLIENT",
    )
    args = parser.parse_args()
    args.server_cpus, client_cpus = parse_pin(args.pin)
    if client_cpus:
        os.sched_setaffinity(0, client_cpus)  # the broker, started next, too
    root = Path(tempfile.mkdtemp(prefix="cleave-stream-measure-"))
    broker = Broker(root / "kafka").start()
    try:
        measure(args, root, broker)
    finally:
        broker.stop()
        shutil.rmtree(root, ignore_errors=True)


def deployment(root: Path, scale: float):
    model, example = MODELS["dlrm"].factory(scale=scale, seed=0)
    bundle = cleave.partition(model.eval(), example)
    path = bundle.save(root / "dlrm")
    plan_path = root / "plan.yaml"
    subprocess.run(
        [sys.executable, "-m", "cleave.cli", "plan", str(path), "--hosts", "4"]
        + ["--shards", "1", "--replicas", "2", "-o", str(plan_path)],
        check=True,
        capture_output=True,
    )
    plan = load_plan(plan_path)
    for shard in plan.shards:
        shard.state_dir = f"state/{shard.name}"
    for role in [*plan.shards, *plan.rankers]:
        role.port = role.metrics_port = 0
    for router in plan.routers:
        router.http_port = 0
    save_plan(plan, plan_path)
    return bundle, path, plan_path, plan.name


def measure(args, root: Path, broker: Broker) -> None:
    from confluent_kafka import Producer

    bundle, path, plan_path, name = deployment(root, args.scale)
    manifest = json.loads((path / "manifest.json").read_text())
    tables = {t["name"]: t for t in manifest["tables"]}
    rows = {
        n: np.fromfile(path / t["file"], np.uint8).reshape(t["rows"], t["row_bytes"])
        for n, t in tables.items()
    }
    generator = RequestGenerator("dlrm", scale=args.scale, seed=7, min_pooling=1)
    requests = [generator.batch(8) for _ in range(16)]
    bodies = [infer_body(bundle.named_inputs(*a)) for a in requests]
    broker.create_topic(TOPIC)
    # The records, encoded before the load: producing is the producers' work, elsewhere.
    rng = np.random.default_rng(0)
    names = sorted(tables, key=lambda n: -tables[n]["rows"])[:3]
    records = []
    for i in range(args.updates):
        table = tables[names[i % len(names)]]
        at = int(rng.integers(0, table["rows"]))
        row = rng.standard_normal((1, table["dim"])).astype(np.float32)
        rows[table["name"]][at] = row.view(np.uint8)
        records.append((record_key(name, table["name"]), encode_record(name, table, [at], row)))
    with pinned(args.server_cpus):
        server = ServeProcess(None, "--plan", str(plan_path)).start()
    try:
        url = f"{server.url}/v2/models/{name}/infer"
        capacity = closed_loop(url, bodies, clients=8, duration_s=5.0)
        ok = [s for s in capacity if s.status == 200]
        rate = len(ok) / 5.0 / 2
        print(f"capacity {len(ok) / 5.0:.0f} requests/s (8 clients); load {rate:.0f}/s")
        report("baseline, no stream (10 s)", open_loop(url, bodies, rate, 10.0))
        log = (root / "stream.log").open("w")
        with pinned(args.server_cpus):
            consumer = subprocess.Popen(
                [sys.executable, "-m", "cleave.cli", "stream", "--plan", str(plan_path)]
                + ["--router", server.url, "--bootstrap", broker.bootstrap, "--topic", TOPIC]
                + ["--group", GROUP],
                stderr=log,
            )
        samples: list = []
        load = threading.Thread(
            target=lambda: samples.extend(open_loop(url, bodies, rate, args.load_s))
        )
        load.start()
        time.sleep(3.0)  # the load runs before, during and after the stream
        producer = Producer({"bootstrap.servers": broker.bootstrap, "linger.ms": 20})
        started = time.monotonic()
        step = max(1, int(args.rate / 10))  # a tenth of a second's records at a time
        for i in range(0, len(records), step):
            for key, value in records[i : i + step]:
                producer.produce(TOPIC, value=value, key=key)
            producer.poll(0)
            time.sleep(max(0.0, started + (i + step) / args.rate - time.monotonic()))
        assert producer.flush(60) == 0
        produced = time.monotonic()
        print(f"{args.updates} records produced in {produced - started:.1f} s")
        committed = wait_committed(broker, args.updates, root / "stream.log")
        print(
            f"last batch serving {committed - produced:.1f} s after the last record was "
            f"produced ({committed - started:.1f} s after the first)"
        )
        load.join()
        consumer.terminate()
        consumer.wait(30)
        report(f"during the stream ({args.load_s:.0f} s)", samples)
        expected = Bundle(manifest, rows, bundle.dense_program)
        worst = 0.0
        for a, body in zip(requests, bodies, strict=True):
            status, reply = post(url, body)
            assert status == 200, reply
            with torch.inference_mode():
                want = [t.double().numpy() for t in pytree.tree_leaves(expected.reference(*a))]
            for g, w in zip(outputs_of(reply), want, strict=True):
                worst = max(worst, float(np.abs(g - w).max()))
        print(f"final scores vs the model with every update: max abs diff {worst:.2e}")
        batches = (root / "stream.log").read_text().count("batch of ")
        print(f"batches {batches}")
    finally:
        server.stop()


def report(what: str, samples: list) -> None:
    failed = [s for s in samples if s.status != 200]
    ok = sorted(s.latency_s for s in samples if s.status == 200)
    line = f"{what}: requests {len(samples)}, failed {len(failed)}"
    if ok:
        line += f", p50 {ok[len(ok) // 2] * 1e3:.1f} ms, p99 {ok[int(len(ok) * 0.99)] * 1e3:.1f} ms"
    if failed:
        seconds = Counter(int(s.scheduled_s) for s in failed)
        kinds = dict(Counter(s.error for s in failed))
        line += f"; failures {kinds} by second {sorted(seconds.items())}"
    print(line)


def wait_committed(broker: Broker, end: int, log: Path) -> float:
    from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    request = ConsumerGroupTopicPartitions(GROUP, [TopicPartition(TOPIC, 0)])
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = admin.list_consumer_group_offsets([request])[GROUP].result(timeout=10)
        if found.topic_partitions[0].offset >= end:
            return time.monotonic()
        time.sleep(0.05)
    raise SystemExit(f"not committed after 300 s; the consumer's log:\n{log.read_text()[-3000:]}")


if __name__ == "__main__":
    main()
