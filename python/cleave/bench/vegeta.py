"""An independent open-loop load generator for `cleave bench serve --overload --generator
vegeta`: vegeta (github.com/tsenart/vegeta: $VEGETA, else the checkout's .tools/bin, which
`make tools` fills, else PATH) sends each phase at a
constant rate, one attack per phase, and its results come back as the project generator's
samples, so every number of the overload report is computed the same way for both."""

from __future__ import annotations

import base64
import csv
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from cleave.bench.loadgen import Sample
from cleave.errors import UsageError


def binary() -> str:
    """The vegeta executable, or a UsageError that says how to get one."""
    built = Path(__file__).resolve().parents[3] / ".tools" / "bin" / "vegeta"
    found = os.environ.get("VEGETA") or (str(built) if built.exists() else shutil.which("vegeta"))
    if not found:
        raise UsageError(
            "--generator vegeta: no vegeta in $VEGETA, .tools/bin or on PATH: `make tools` "
            "builds it (or `go install github.com/tsenart/vegeta/v12@v12.12.0`)"
        )
    return found


def open_loop_phases(
    urls: Sequence[str],
    bodies: Sequence[bytes],
    phases: Sequence[tuple[float, float]],
    timeout_s: float,
) -> list[Sample]:
    """Each phase's (rate, seconds) as one vegeta attack, in turn; a sample's `scheduled_s`
    counts from the first attack's first request. The bodies go round-robin, each to every
    URL in turn (a plan's routers share the rate)."""
    vegeta = binary()
    with tempfile.TemporaryDirectory(prefix="cleave-vegeta-") as tmp:
        targets = Path(tmp) / "targets.json"
        with targets.open("w") as f:
            for body in bodies:
                headers = {k: [v] for k, v in getattr(body, "headers", {}).items()}
                headers.setdefault("Content-Type", ["application/json"])
                encoded = base64.b64encode(bytes(body)).decode()
                for url in urls:
                    line = {"method": "POST", "url": url, "header": headers, "body": encoded}
                    f.write(json.dumps(line) + "\n")
        rows, sent = [], []
        for i, (rate, seconds) in enumerate(phases):
            out = Path(tmp) / f"phase-{i}.bin"
            sent.append((max(1, round(rate)), seconds))
            attack = [vegeta, "attack", "-format=json", f"-targets={targets}"]
            attack += [f"-rate={sent[-1][0]}/1s", f"-duration={seconds}s"]
            attack += [f"-timeout={timeout_s}s", "-max-body=0", f"-output={out}"]
            subprocess.run(attack, check=True, capture_output=True, timeout=seconds + 60)
            encoded = subprocess.run(
                [vegeta, "encode", "--to", "csv", str(out)],
                check=True,
                capture_output=True,
                text=True,
                timeout=120,
            )
            rows.append((i, list(csv.reader(encoded.stdout.splitlines()))))
    return _samples(rows, sent, len(bodies), len(urls))


def _samples(rows, phases: list[tuple[int, float]], bodies: int, urls: int = 1) -> list[Sample]:
    """vegeta's CSV rows (nanosecond timestamp, status, latency ns, bytes out, bytes in,
    error, body, name, sequence, ...) of each phase sent at (rate, seconds) as samples, each
    phase placed after the ones before it. A request is placed where vegeta's constant pacer
    scheduled it (sequence / rate), and its latency counts from there, as the project's
    generator counts its own: a request vegeta sent late is late by the client's lag too, and
    stays in its phase."""
    samples = []
    offset = 0.0
    for i, phase in rows:
        rate, seconds = phases[i]
        first = min((int(r[0]) for r in phase), default=0)  # the first request's, sequence 0
        for r in phase:
            status, error, seq = int(r[1]), r[5], int(r[8])
            lag = max(0.0, (int(r[0]) - first) / 1e9 - seq / rate)
            target = seq % (bodies * urls)  # the targets file: each body, every URL
            sample = Sample(target // urls, offset + seq / rate, lag, lag + int(r[2]) / 1e9, status)
            sample.router = target % urls
            if status and status != 200:
                sample.error = f"http_{status}"
            elif not status:  # no answer: vegeta's own timeout, or the connection failed
                timeout = "Timeout" in error or "deadline exceeded" in error
                sample.error = "timeout" if timeout else "connection"
                sample.detail = _reason(error)
            samples.append(sample)
        offset += seconds
    samples.sort(key=lambda s: s.scheduled_s)
    return samples


def _reason(error: str) -> str:
    """Go's `Post "URL": read tcp A->B: read: connection reset by peer` without the URL and the
    addresses, which differ per request: `read tcp: read: connection reset by peer`."""
    return re.sub(r"(tcp[46]?) [^ ]+: ", r"\1: ", error.rsplit('": ', 1)[-1])
