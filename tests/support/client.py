"""HTTP requests of the tests (stdlib only, so a failing request shows the server's own
answer) and closed-loop load."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request


def request(url: str, body: bytes | None = None, timeout: float = 60.0) -> tuple[int, str]:
    """GET (no body) or POST a JSON body: (status, the answer's text), errors included."""
    method = "GET" if body is None else "POST"
    req = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json"}, method=method
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        # An error without a body (its stream already gone) still says what it was.
        body = err.read() if err.fp is not None else str(err.reason).encode()
        return err.code, body.decode(errors="replace")


def post(url: str, body: bytes | dict, timeout: float = 60.0) -> tuple[int, dict]:
    """POST a JSON body (bytes, or an object to encode): (status, the JSON answer, or
    {"error": text} when it is not JSON)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, text = request(url, raw, timeout)
    try:
        return status, json.loads(text)
    except ValueError:
        return status, {"error": text}


def post_retrying(url: str, body: bytes | dict, tries: int = 5) -> tuple[int, dict]:
    """`post`, retried after the `Retry-After` of each 503 (as clients of a shedding server
    do), at most `tries` times: for tests of scores, not of admission, on a busy machine."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    for _ in range(tries - 1):
        req = urllib.request.Request(url, data=raw, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            if err.code != 503:
                return err.code, json.loads(err.read() or b"{}")
            time.sleep(float(err.headers.get("Retry-After", "1")))
    return post(url, raw)


def closed_loop(url: str, requests, workers: int = 3, pace_s: float = 0.0):
    """Clients that each send the next request when the last one answered (and `pace_s` after
    it was sent: requests flowing through a change without taking the cores the suite's other
    workers need), until stopped; returns (results, stop): results are (time answered,
    seconds, status, reply, want)."""
    results, stop = [], threading.Event()

    def load(worker: int) -> None:
        i = worker
        while not stop.is_set():
            body, want = requests[i % len(requests)]
            start = time.monotonic()
            status, reply = post(url, body, timeout=30)
            results.append((time.monotonic(), time.monotonic() - start, status, reply, want))
            i += 1
            stop.wait(pace_s - (time.monotonic() - start))

    threads = [threading.Thread(target=load, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()

    def finish() -> None:
        stop.set()
        for t in threads:
            t.join(60)

    return results, finish


def failures(results) -> list:
    """The (status, reply) of every closed-loop result that was not a 200."""
    return [(status, reply) for _, _, status, reply, _ in results if status != 200]
