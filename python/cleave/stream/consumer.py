"""`cleave stream`: follows a Kafka topic of row updates (docs/streaming.md) and applies them
to every live shard replica with `cleave update`'s two phases, one batch at a time.

A batch closes at --batch-records records or --batch-ms after its first record. Its records
are checked (malformed ones are counted, logged and skipped); the rows of each table become
one delta; all the batch's tables are staged on every shard holding them and switched at one
time (a request reads the whole batch or none of it); once that time has passed (the rows
serve), the batch's offsets are committed. Each switch records, on the shard, the topic
partitions' last offsets it applied (`source`); before a batch, each shard's record says what
it already has, so a consumer that died after a switch and before its commit applies nothing
twice, and a shard that has a batch is not sent it again.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cleave.errors import CleaveError
from cleave.shard_update import table_status
from cleave.stream.record import RecordError, decode_record
from cleave.update import (
    SWITCH_MARGIN_S,
    Change,
    UpdateError,
    announce_to,
    apply_changes,
    bundle_tables,
    live_shards,
    use_plan_secret,
    write_delta,
)

log = logging.getLogger("cleave.stream")
SERVED_VERSION = "1"  # the version a deployment of one bundle serves (the router's)
BACKOFF_S = (0.2, 5.0)  # first and longest wait between retries of a failed step
# Test hook (tests/test_stream.py): exit between a batch's switch and its offset commit.
EXIT_BEFORE_COMMIT_ENV = "CLEAVE_STREAM_EXIT_BEFORE_COMMIT"


class StreamError(CleaveError):
    """A bad flag, plan or bundle for `cleave stream`."""


def add_arguments(parser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--plan", help="the deployment plan (its bundle, model name, secret)")
    what.add_argument("--bundle", help="the bundle served (`cleave serve BUNDLE`)")
    what.add_argument(
        "--repository",
        metavar="REPO",
        help="a model repository `cleave serve REPO` serves: --name and --model-version say "
        "which of its versions takes the rows (docs/repository.md)",
    )
    parser.add_argument(
        "--name", help="the model's name (with --bundle, default: its directory; --repository)"
    )
    parser.add_argument(
        "--model-version",
        default=SERVED_VERSION,
        help="the version served; records naming another are malformed (default 1)",
    )
    parser.add_argument("--router", required=True, metavar="URL", help="the router's base URL")
    parser.add_argument(
        "--admin-token-env", default="", help="variable holding the router's admin token"
    )
    parser.add_argument("--bootstrap", required=True, metavar="HOST:PORT", help="Kafka brokers")
    parser.add_argument("--topic", required=True, help="the topic of row updates")
    parser.add_argument("--group", required=True, help="the Kafka consumer group")
    parser.add_argument(
        "--instance",
        help="a static member id in the group: a restarted consumer with the same id takes "
        "its partitions back at once, not after the group's session timeout",
    )
    parser.add_argument(
        "--batch-records", type=int, default=10000, help="a batch closes at N records (10000)"
    )
    parser.add_argument(
        "--batch-ms",
        type=float,
        default=1000.0,
        help="... or this long after its first record (1000)",
    )
    parser.add_argument(
        "--switch-margin-ms",
        type=float,
        default=SWITCH_MARGIN_S * 1e3,
        help="as `cleave update`'s: from the switch to when the batch serves (2000)",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per shard step")
    parser.add_argument(
        "--metrics", metavar="HOST:PORT", help="serve /metrics here (port 0: a free one)"
    )


def run(args) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.batch_records < 1:
        raise StreamError(f"--batch-records: expected at least 1, got {args.batch_records}")
    if not 1 <= args.batch_ms <= 600_000:
        raise StreamError(f"--batch-ms: expected 1..600000, got {args.batch_ms}")
    if not 0 <= args.switch_margin_ms <= 600_000:
        raise StreamError(f"--switch-margin-ms: expected 0..600000, got {args.switch_margin_ms}")
    target = Deployment.from_args(args)
    try:
        from confluent_kafka import Consumer
    except ImportError:
        raise StreamError("cleave stream needs confluent-kafka (the `stream` extra)") from None
    config = {
        "bootstrap.servers": args.bootstrap,
        "group.id": args.group,
        "enable.auto.commit": False,  # committed once the batch serves
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        "max.poll.interval.ms": 600_000,  # a batch retried while a shard restarts
        "session.timeout.ms": 10_000,  # a dead consumer's partitions move on after 10 s
    }
    if args.instance:
        config["group.instance.id"] = args.instance
    metrics = Metrics()
    if args.metrics:
        print(f"metrics on http://{metrics.serve(args.metrics)}/metrics", file=sys.stderr)
    stream = Stream(
        target,
        lambda: Consumer(config),
        args.topic,
        args.batch_records,
        args.batch_ms / 1e3,
        args.switch_margin_ms / 1e3,
        args.timeout,
        metrics,
    )
    for sig in (signal.SIGTERM, signal.SIGINT):  # stop between batches, leave the group
        signal.signal(sig, lambda *_: stream.stop())
    stream.run()
    return 0


@dataclass
class Deployment:
    """What records are checked against (the model's name, version and tables) and where
    they are applied (the router's live shards)."""

    model: str
    version: str
    tables: dict[str, dict]
    router: str
    token: str | None = None
    repository: bool = False  # the router serves several versions: ask for this one's shards

    @classmethod
    def from_args(cls, args) -> Deployment:
        if args.plan:
            from cleave.plan.files import load_plan

            plan = load_plan(args.plan)
            bundle, name = plan.bundle_path(), plan.name
            use_plan_secret(plan)
        elif args.repository:
            if not args.name:
                raise StreamError("--repository needs --name MODEL (and --model-version V)")
            from cleave.bundle.repository import version_bundle

            try:
                bundle = version_bundle(args.repository, args.name, args.model_version)
            except ValueError as err:
                raise StreamError(str(err)) from None
            name = args.name
        else:
            bundle = Path(args.bundle)
            name = args.name or bundle.resolve().name
        tables = bundle_tables(bundle)
        token = os.environ.get(args.admin_token_env) if args.admin_token_env else None
        repository = bool(args.repository)
        return cls(name, args.model_version, tables, args.router, token, repository)

    def shards(self, table: str) -> list[str]:
        version = (self.model, self.version) if self.repository else None
        return live_shards(self.router, table, self.token, version)


class Metrics:
    """The consumer's counters, on /metrics when served and in each batch's log line."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.records = Counter(
            "cleave_stream_records",
            "Records read, by outcome: applied, malformed (skipped), duplicate (a shard had it)",
            ["outcome"],
            registry=self.registry,
        )
        self.batches = Counter(
            "cleave_stream_batches",
            "Batch attempts, by outcome: committed, retried (a failed update or commit)",
            ["outcome"],
            registry=self.registry,
        )
        self.serving = Gauge(
            "cleave_stream_last_batch_serving_unix_seconds",
            "When the last committed batch started serving",
            registry=self.registry,
        )

    def serve(self, listen: str) -> str:
        from prometheus_client import start_http_server

        host, _, port = listen.rpartition(":")
        server, _ = start_http_server(int(port), addr=host or "127.0.0.1", registry=self.registry)
        return f"{host or '127.0.0.1'}:{server.server_port}"

    def count(self, outcome: str) -> int:
        return int(self.records.labels(outcome)._value.get())


class _RateLimited:
    """Logs at most one line a second; says how many it held back."""

    def __init__(self, every_s: float = 1.0):
        self.every_s, self.last, self.held = every_s, 0.0, 0

    def warning(self, message: str, *args) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s:
            self.held += 1
            return
        more = f" (and {self.held} more since the last line)" if self.held else ""
        log.warning(message + more, *args)
        self.last, self.held = now, 0


class _Fatal(Exception):
    """The Kafka client cannot go on; a new one must be made."""


@dataclass
class _Batch:
    """A batch's usable records per table: (partition, offset, Record) each."""

    rows: dict[str, list] = field(default_factory=lambda: defaultdict(list))


class Stream:
    """The consume, apply, commit loop of one consumer (run it with `run`; `stop` ends it
    between batches)."""

    def __init__(
        self,
        deployment: Deployment,
        connect,
        topic: str,
        batch_records: int,
        batch_s: float,
        switch_margin_s: float,
        timeout_s: float,
        metrics: Metrics,
    ):
        self.deployment, self.connect, self.topic = deployment, connect, topic
        self.batch_records, self.batch_s = batch_records, batch_s
        self.switch_margin_s, self.timeout_s, self.metrics = switch_margin_s, timeout_s, metrics
        self.owned: set[int] = set()
        self.stopping = threading.Event()
        self.malformed_log = _RateLimited()
        self.workdir = Path(tempfile.mkdtemp(prefix="cleave-stream-"))

    def stop(self) -> None:
        self.stopping.set()

    def run(self) -> None:
        self._subscribe()
        log.info("following %s for model %s", self.topic, self.deployment.model)
        try:
            while not self.stopping.is_set():
                try:
                    messages = self._collect()
                    messages = [m for m in messages if m.partition() in self.owned]
                    if messages:
                        self._apply(messages)
                except _Fatal as err:
                    # A client in a fatal state (fenced by the group, say) never recovers: a
                    # new one reads from the committed offsets, and the shards' sources say
                    # what was applied since.
                    log.warning("kafka client failed (%s): connecting a new one", err)
                    self._close()
                    self._subscribe()
        finally:
            self._close()
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _subscribe(self) -> None:
        self.owned = set()
        self.consumer = self.connect()
        self.consumer.subscribe([self.topic], on_assign=self._assigned, on_revoke=self._revoked)

    def _close(self) -> None:
        try:
            self.consumer.close()
        except Exception as err:  # a fatal client may refuse to leave the group cleanly
            log.warning("closing the kafka client: %s", err)

    def _assigned(self, _consumer, partitions) -> None:
        self.owned |= {p.partition for p in partitions}
        log.info("assigned partitions %s", sorted(p.partition for p in partitions))

    def _revoked(self, _consumer, partitions) -> None:
        # Records of these partitions read and not applied are read again by their new owner.
        self.owned -= {p.partition for p in partitions}
        log.info("revoked partitions %s", sorted(p.partition for p in partitions))

    def _collect(self) -> list:
        """One batch: up to batch_records records, closed batch_s after its first one."""
        out, closes = [], None
        while len(out) < self.batch_records and not self.stopping.is_set():
            wait = 0.5 if closes is None else closes - time.monotonic()
            if wait <= 0:
                break
            for m in self.consumer.consume(min(self.batch_records - len(out), 10000), wait):
                if m.error():
                    if m.error().fatal():
                        raise _Fatal(str(m.error()))
                    log.warning("kafka: %s", m.error())
                    continue
                out.append(m)
                if closes is None:
                    closes = time.monotonic() + self.batch_s
        return out

    def _apply(self, messages: list) -> None:
        """Applies one batch until it serves (retrying failures), then commits it."""
        batch = self._read(messages)
        wait = BACKOFF_S[0]
        while True:
            try:
                applied, duplicate = self._apply_once(batch, len(messages))
                break
            except (UpdateError, OSError) as err:
                self.metrics.batches.labels("retried").inc()
                log.warning("batch not applied, again in %.1f s: %s", wait, err)
                if self.stopping.wait(wait):
                    return
                wait = min(wait * 2, BACKOFF_S[1])
        self.metrics.records.labels("applied").inc(applied)
        self.metrics.records.labels("duplicate").inc(duplicate)
        if os.environ.get(EXIT_BEFORE_COMMIT_ENV) == "1":
            log.warning("%s=1: exiting before the offset commit", EXIT_BEFORE_COMMIT_ENV)
            os._exit(3)
        self._commit(messages)

    def _read(self, messages: list) -> _Batch:
        batch = _Batch()
        d = self.deployment
        for m in messages:
            try:
                record = decode_record(m.value(), d.tables, d.model, d.version)
            except RecordError as err:
                self.metrics.records.labels("malformed").inc()
                self.malformed_log.warning(
                    "skipping malformed record %s[%d]@%d: %s",
                    self.topic, m.partition(), m.offset(), err,
                )  # fmt: skip
                continue
            batch.rows[record.table].append((m.partition(), m.offset(), record))
        return batch

    def _apply_once(self, batch: _Batch, size: int) -> tuple[int, int]:
        """Stages and switches the batch's new rows on the shards that lack them; returns how
        many records that applied and how many every shard had already."""
        changes, applied, duplicate = [], 0, 0
        for table, records in batch.rows.items():
            shards = self.deployment.shards(table)
            if not shards:
                raise UpdateError(f"no live shard holds table {table!r}")
            # What each shard already applied, per partition (its last switch's source).
            have = {a: self._applied(a, table) for a in shards}
            lowest: dict[int, int] = {}
            for p in {p for p, _, _ in records}:
                lowest[p] = min(h.get(p, -1) for h in have.values())
            fresh = [(p, o, r) for p, o, r in records if o > lowest[p]]
            duplicate += len(records) - len(fresh)
            if not fresh:
                continue
            last: dict[int, int] = {}
            for p, o, _ in fresh:
                last[p] = max(last.get(p, -1), o)
            need = [a for a in shards if any(have[a].get(p, -1) < o for p, o in last.items())]
            if not need:
                continue
            offsets = {p: max(o, *(h.get(p, -1) for h in have.values())) for p, o in last.items()}
            for h in have.values():  # keep the other partitions' offsets
                for p, o in h.items():
                    offsets.setdefault(p, o)
            path = self.workdir / f"{table}.delta"
            write_delta(
                path,
                self.deployment.tables[table],
                np.concatenate([r.ids for _, _, r in fresh]),
                np.concatenate([r.rows for _, _, r in fresh]),
            )
            tag = {"topic": self.topic, "offsets": {str(p): o for p, o in sorted(offsets.items())}}
            changes.append(Change(table, path, "rows", need, tag))
            applied += len(fresh)
        if changes:
            started = time.monotonic()
            # The router hears of each switch first, so its cache never answers a request
            # as of after it with a row read before (docs/cache.md).
            announce = announce_to(self.deployment.router, self.deployment.token)
            apply_changes(changes, self.timeout_s, log.info, self.switch_margin_s, announce)
            log.info(
                "batch of %d records serves: %d of them applied to %s in %.2f s",
                size, applied, ", ".join(c.table for c in changes),
                time.monotonic() - started,
            )  # fmt: skip
        return applied, duplicate

    def _applied(self, addr: str, table: str) -> dict[int, int]:
        """The last offset of each partition of our topic that `addr` applied to `table`."""
        source = table_status(addr, table, self.timeout_s).get("source") or {}
        if not isinstance(source, dict) or source.get("topic") != self.topic:
            return {}
        return {int(p): int(o) for p, o in (source.get("offsets") or {}).items()}

    def _commit(self, messages: list) -> None:
        from confluent_kafka import KafkaError, KafkaException, TopicPartition

        last: dict[int, int] = {}
        for m in messages:
            last[m.partition()] = max(last.get(m.partition(), -1), m.offset())
        offsets = [TopicPartition(self.topic, p, o + 1) for p, o in sorted(last.items())]
        try:
            self.consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as err:
            if err.args[0].code() in (
                KafkaError.ILLEGAL_GENERATION,
                KafkaError.UNKNOWN_MEMBER_ID,
                KafkaError.REBALANCE_IN_PROGRESS,
            ):  # the partitions moved: their new owner skips what the shards have
                log.warning("commit dropped (%s): the shards' sources cover it", err)
                return
            # Not retried on this client: after a broker restart librdkafka's client can wait
            # for a group coordinator for good (CI saw every retry fail that way for 90 s). A new
            # client reads from the committed offsets; the shards' sources skip what serves.
            self.metrics.batches.labels("retried").inc()
            raise _Fatal(f"commit failed: {err}") from None
        self.metrics.batches.labels("committed").inc()
        self.metrics.serving.set(time.time())
        log.info(
            "committed %s; records applied %d, malformed %d, duplicate %d",
            ", ".join(f"{t.partition}:{t.offset}" for t in offsets),
            self.metrics.count("applied"),
            self.metrics.count("malformed"),
            self.metrics.count("duplicate"),
        )
