"""A single-node Apache Kafka (KRaft: broker and controller in one JVM) for the streaming tests,
from the jars `make tools` copies into .tools/kafka (tools/kafka/pom.xml). `Broker.start()`
formats its storage once (Kafka's StorageTool), starts `kafka.Kafka` on free loopback ports and
returns once a metadata request answers; `stop()` ends it, and `start()` again restarts it
on the same ports and data (a broker restart)."""

from __future__ import annotations

import base64
import os
import subprocess
import time
import uuid
from pathlib import Path

from cleave.runners.local import free_ports

ROOT = Path(__file__).resolve().parents[2]
LIBS = ROOT / ".tools" / "kafka" / "libs"  # the Makefile's KAFKA_VERSION
START_TIMEOUT_S = 120.0  # the JVM's start on a busy 2-core machine; normally a few seconds

LOG4J = """status = warn
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = out
logger.kafka.name = org.apache.kafka
logger.kafka.level = WARN
"""


class Broker:
    """One KRaft node under `root` (its data, config and log)."""

    def __init__(self, root: Path):
        if not any(LIBS.glob("kafka_2.13-*.jar")):
            raise RuntimeError(f"{LIBS} has no Kafka broker: `make tools` copies it")
        self.root = root
        self.port, self.controller_port = free_ports("127.0.0.1", 2)
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log_path = root / "broker.log"
        root.mkdir(parents=True, exist_ok=True)
        (root / "log4j2.properties").write_text(LOG4J)
        self.config = root / "server.properties"
        self.config.write_text(
            "\n".join(
                [
                    "process.roles=broker,controller",
                    "node.id=1",
                    f"controller.quorum.voters=1@127.0.0.1:{self.controller_port}",
                    f"listeners=PLAINTEXT://127.0.0.1:{self.port},"
                    f"CONTROLLER://127.0.0.1:{self.controller_port}",
                    f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}",
                    "controller.listener.names=CONTROLLER",
                    "inter.broker.listener.name=PLAINTEXT",
                    "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
                    f"log.dirs={root / 'data'}",
                    "num.partitions=1",
                    "offsets.topic.replication.factor=1",
                    "offsets.topic.num.partitions=1",
                    "transaction.state.log.replication.factor=1",
                    "transaction.state.log.min.isr=1",
                    "share.coordinator.state.topic.replication.factor=1",
                    "share.coordinator.state.topic.min.isr=1",
                    "group.initial.rebalance.delay.ms=0",
                    "auto.create.topics.enable=true",
                ]
            )
            + "\n"
        )
        cluster = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        # --cluster-id=ID: an ID starting with "-" is not read as an option.
        self._java(
            "kafka.tools.StorageTool", "format", f"--cluster-id={cluster}", "-c", str(self.config)
        )

    def _command(self, main: str, *args: str) -> list[str]:
        return [
            "java", "-Xms128m", "-Xmx512m", "-XX:+UseSerialGC",
            f"-Dlog4j2.configurationFile={self.root / 'log4j2.properties'}",
            "-cp", f"{LIBS}/*", main, *args,
        ]  # fmt: skip

    def _java(self, main: str, *args: str) -> None:
        done = subprocess.run(
            self._command(main, *args), capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise RuntimeError(f"{main} {' '.join(args)}: {done.stdout}{done.stderr}")

    def start(self) -> Broker:
        from confluent_kafka.admin import AdminClient

        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self._command("kafka.Kafka", str(self.config)),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # a metadata request answered by the broker: it serves
            if self.process.poll() is not None:
                raise RuntimeError(f"the broker exited: {self.tail()}")
            try:
                if admin.list_topics(timeout=1).brokers:
                    return self
            except Exception:  # KafkaException until the listener accepts
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the broker did not answer in {START_TIMEOUT_S} s")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, 15)  # a clean shutdown: it flushes its logs
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait()

    def tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def create_topic(self, name: str, partitions: int = 1) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        futures = admin.create_topics([NewTopic(name, partitions, 1)])
        futures[name].result(timeout=30)
