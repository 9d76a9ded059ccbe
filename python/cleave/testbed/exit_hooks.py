"""Cleanup when the owning process exits: atexit for a normal exit, and SIGTERM/SIGHUP turned
into SystemExit (so atexit runs) when nobody else handles them. SIGKILL cannot be caught: the
next up() anywhere on the machine removes what a killed owner left."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_live: dict[int, Callable[[], None]] = {}
_lock = threading.Lock()
_atexit_registered = False
_installed: dict[int, object] = {}


def _exit_on_signal(signum, _frame):
    raise SystemExit(128 + signum)


def _run_all() -> None:
    with _lock:
        downs = list(_live.values())
    for down in downs:
        try:
            down()
        except Exception as err:  # keep removing the others; the next up() reclaims this one
            log.warning("testbed cleanup at exit failed: %s", err)


def register(key: int, down: Callable[[], None]) -> None:
    global _atexit_registered
    owner_pid = os.getpid()

    def guarded() -> None:
        if os.getpid() == owner_pid:  # a forked child must not remove its parent's testbed
            down()

    with _lock:
        _live[key] = guarded
        if not _atexit_registered:
            atexit.register(_run_all)
            _atexit_registered = True
    if threading.current_thread() is threading.main_thread():
        for sig in _SIGNALS:
            if signal.getsignal(sig) is signal.SIG_DFL:
                _installed[sig] = signal.signal(sig, _exit_on_signal)


def unregister(key: int) -> None:
    with _lock:
        _live.pop(key, None)
        empty = not _live
    if empty and threading.current_thread() is threading.main_thread():
        for sig, previous in list(_installed.items()):
            if signal.getsignal(sig) is _exit_on_signal:  # someone replaced it: leave theirs
                signal.signal(sig, previous)
            del _installed[sig]
