"""The stream consumer's offset commit against a stand-in Kafka client (one piece: what a
commit's failure leads to; tests/test_stream.py runs the whole loop on a real broker)."""

from __future__ import annotations

import shutil

import pytest
from cleave.stream.consumer import Metrics, Stream, _Fatal

kafka = pytest.importorskip("confluent_kafka")


class Message:
    def __init__(self, offset: int):
        self._offset = offset

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset


class Client:
    """Fails its first commit with `code`, then commits."""

    def __init__(self, code: int):
        self.code, self.commits = code, []

    def commit(self, offsets, asynchronous):
        self.commits.append([(t.partition, t.offset) for t in offsets])
        if len(self.commits) == 1:
            raise kafka.KafkaException(kafka.KafkaError(self.code))


@pytest.fixture
def stream():
    s = Stream(None, None, "rows", 100, 0.1, 0.0, 1.0, Metrics())
    yield s
    shutil.rmtree(s.workdir, ignore_errors=True)


def test_a_commit_that_cannot_reach_a_coordinator_replaces_the_client(stream):
    """CI once saw a client whose broker restarted fail every commit with "waiting for
    coordinator" for as long as the test waited: a failed commit is not retried on the same
    client; a new one reads from the committed offsets (the shards' sources skip the rest)."""
    stream.consumer = client = Client(kafka.KafkaError._WAIT_COORD)
    with pytest.raises(_Fatal, match="commit"):
        stream._commit([Message(3), Message(4)])
    assert client.commits == [[(0, 5)]]
    assert stream.metrics.batches.labels("committed")._value.get() == 0


@pytest.mark.parametrize("code", ["ILLEGAL_GENERATION", "UNKNOWN_MEMBER_ID"])
def test_a_commit_refused_because_the_partitions_moved_is_dropped(stream, code):
    stream.consumer = client = Client(getattr(kafka.KafkaError, code))
    stream._commit([Message(7)])  # returns: the partitions' new owner skips what serves
    assert client.commits == [[(0, 8)]]
