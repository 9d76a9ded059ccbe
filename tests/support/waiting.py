"""The one readiness wait: poll a predicate until it holds, or fail naming what was awaited."""

from __future__ import annotations

import time

POLL_S = 0.02
DEFAULT_TIMEOUT_S = 30.0


def wait_for(predicate, what: str, timeout_s: float = DEFAULT_TIMEOUT_S):
    """Polls `predicate()` until it returns something true and returns that; after
    `timeout_s` fails with "timed out after N s waiting for WHAT". The timeout bounds a
    hang; it is never a timing assertion."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(POLL_S)
