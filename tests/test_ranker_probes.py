"""The ranker's HTTP probes over real HTTP: `/live`, `/ready` in the shared health schema,
`/metrics` from prometheus-client reading the batching loop's counters."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import deque
from types import SimpleNamespace

from cleave.ranker.batcher import BatchStats
from cleave.ranker.dense_dtype import DenseChoice
from cleave.ranker.probes import Probes, measured_activation


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_probes_report_health_and_the_loops_counters():
    choice = DenseChoice("int8", "probe", {"float32": 0.041, "int8": 0.0125}, 100)
    batcher = SimpleNamespace(
        stats=BatchStats(requests=7, batches=3, dropped_deadline=2),
        queue=deque([1, 2]),
        dense_choice=choice,
        activation_bytes=68660,
    )
    probes = Probes(batcher)
    try:
        assert get(probes.address + "/live") == (200, b'{"live":true}')
        status, body = get(probes.address + "/ready")
        assert status == 200
        assert json.loads(body) == {
            "role": "ranker",
            "status": "ready",
            "ready": True,
            "degraded": [],
            "problems": [],
        }
        text = get(probes.address + "/metrics")[1].decode()
        assert 'cleave_ranker_requests_total{outcome="ok"} 7.0' in text
        assert 'cleave_ranker_requests_total{outcome="deadline"} 2.0' in text
        assert "cleave_ranker_batches_total 3.0" in text
        assert "cleave_ranker_queue_depth 2.0" in text
        assert 'cleave_ranker_dense_dtype{chosen_by="probe",dtype="int8"} 1.0' in text
        probed = 'cleave_ranker_dense_probe_seconds{dtype="%s",rows="100"} %s'
        assert probed % ("float32", "0.041") in text and probed % ("int8", "0.0125") in text
        assert "cleave_ranker_activation_bytes_per_row 68660.0" in text
        assert measured_activation(text) == 68660  # what the Ray runner reads
        probes.problems.append("stopping")
        status, body = get(probes.address + "/ready")
        assert status == 503 and json.loads(body)["problems"] == ["stopping"]
        assert get(probes.address + "/nowhere")[0] == 404
    finally:
        probes.close()
