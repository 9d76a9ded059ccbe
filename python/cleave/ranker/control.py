"""The ranker's incast control port (docs/traffic.md, "Wiring it into the router → ranker
path"): routers ask here before sending a large fused payload (request-to-send {trace id,
bytes, budget left}) and are granted within the incast window. The window and the queue
policies are crate cleave-flow's, through `cleave._native.IncastScheduler`; the codec is its
too (`encode_control` / `decode_control`).

One thread serves every control connection (a selector; frames are tiny). Each connection is
one sender to the scheduler; when it goes, its queued requests and in-flight bytes go with it.
A malformed frame is answered with an error frame naming what was expected and what arrived,
and that connection is closed; the others go on. `ControlledSource` wraps the data source
(the FrameServer): a payload read off its connection releases its window space
(`complete`) at once, not when the batching loop next asks for work.

With an adaptive window (`--incast-adaptive`), the same thread samples congestion every
interval (`CongestionMeter`: out-of-order segments per MiB and the share of the link used,
from the data connections' TCP_INFO) and sets the window `cleave._native.AdaptiveWindow`
decides, the controller of `cleave bench incast`."""

from __future__ import annotations

import collections
import logging
import selectors
import socket
import threading
import time

from cleave._native import CONTROL_DSCP, IncastScheduler, decode_control, encode_control
from cleave.ranker.local import take

log = logging.getLogger("cleave.ranker.control")

_POLL_S = 0.1  # how often the control thread looks at its stop flag
_READ = 4096
_MAX_BUFFER = 64 << 10  # a sender this far ahead of us is not speaking the protocol
_SEND_TIMEOUT_S = 1.0  # a control frame that cannot leave in this long: the peer is stuck


def mark_control(sock: socket.socket) -> None:
    """Grants and expiries go in the network's priority class, as every control connection's
    packets do (DSCP EF: docs/protocol.md, "Priority of control traffic")."""
    v6 = sock.family == socket.AF_INET6
    level, name = (
        (socket.IPPROTO_IPV6, socket.IPV6_TCLASS) if v6 else (socket.IPPROTO_IP, socket.IP_TOS)
    )
    try:
        sock.setsockopt(level, name, CONTROL_DSCP << 2)
    except OSError as err:  # the connection still works, without priority
        log.debug("cannot mark a control connection's packets: %s", err)


class CongestionMeter:
    """What one interval of the data connections' kernel counters says (`counters()` returns
    `[(conn_id, out_of_order_segments, bytes_received)]`, cumulative per connection, as
    `FrameServer.receiver_stats`): out-of-order segments per MiB received — each one a
    segment lost at the queue in front of this host — and bytes received over what the link
    could carry. A connection first seen counts from its opening; a gone one drops out."""

    _MIN_MIB = 0.25  # a few stray segments in an idle interval are not congestion

    def __init__(self, counters, link_bytes_per_s: float):
        self._counters = counters
        self._link = link_bytes_per_s
        self._last: dict[int, tuple[int, int]] = {}

    def sample(self, interval_s: float) -> tuple[float, float]:
        ooo = received = 0
        now = {conn: (o, b) for conn, o, b in self._counters()}
        for conn, (o, b) in now.items():
            o0, b0 = self._last.get(conn, (0, 0))
            ooo, received = ooo + max(0, o - o0), received + max(0, b - b0)
        self._last = now
        congestion = ooo / max(received / (1 << 20), self._MIN_MIB)
        return congestion, received / (self._link * max(interval_s, 1e-6))


class _Sender:
    def __init__(self, sock: socket.socket, number: int):
        self.sock = sock
        self.number = number
        self.buffer = b""


class ControlServer:
    """Listens on `host:port` (0 picks one; `address` says which) and grants through
    `scheduler`. `close()` stops the thread and every connection."""

    def __init__(
        self,
        host: str,
        port: int,
        scheduler: IncastScheduler,
        adaptive=None,
        meter: CongestionMeter | None = None,
        interval_s: float = 0.05,
    ):
        """`adaptive` (a `cleave._native.AdaptiveWindow`) and `meter`: set the window from
        congestion every `interval_s`; without them the window stays as `scheduler` has it."""
        self.scheduler = scheduler
        self._adaptive, self._meter, self._interval_s = adaptive, meter, interval_s
        self.window_changes = 0
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(64)
        self._listener.setblocking(False)
        bound = self._listener.getsockname()
        self.address = f"{host}:{bound[1]}" if ":" not in host else f"[{host}]:{bound[1]}"
        self._lock = threading.Lock()  # the scheduler's decisions and the writes they cause
        self._senders: dict[int, _Sender] = {}
        self._granted: dict[int, int] = {}  # message id (the router's trace id) -> sender
        self._next = 0
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self.malformed = 0
        self._thread = threading.Thread(target=self._run, name="incast-control", daemon=True)
        self._thread.start()

    def complete(self, message_id: int) -> None:
        """Every byte of message `message_id` arrived (the batching loop received it)."""
        with self._lock:
            sender = self._granted.pop(message_id, None)
            if sender is not None:
                self._apply(self.scheduler.complete(sender, message_id))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            for s in list(self._senders.values()):
                s.sock.close()
            self._senders.clear()
        self._listener.close()
        self._selector.close()

    def _run(self) -> None:
        adapts = self._adaptive is not None and self._meter is not None
        last = time.monotonic()
        while not self._stop.is_set():
            timeout = _POLL_S
            if adapts:
                timeout = max(0.0, min(timeout, last + self._interval_s - time.monotonic()))
            for key, _ in self._selector.select(timeout=timeout):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)
            now = time.monotonic()
            if adapts and now - last >= self._interval_s:
                self._adapt(now - last)
                last = now

    def _adapt(self, interval_s: float) -> None:
        """One interval of the adaptive window: measure, decide, apply (grants a larger
        window allows go out now)."""
        congestion, utilization = self._meter.sample(interval_s)
        with self._lock:
            backlog = self.scheduler.queued > 0
            limit = self._adaptive.observe(congestion, utilization, backlog)
            if limit != self.scheduler.limit:
                self.window_changes += 1
                log.debug(
                    "incast window %d bytes (congestion %.2f, utilization %.2f)",
                    limit,
                    congestion,
                    utilization,
                )
                self._apply(self.scheduler.set_limit(limit))

    def _accept(self) -> None:
        try:
            sock, peer = self._listener.accept()
        except OSError:
            return
        sock.setblocking(True)
        sock.settimeout(_SEND_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mark_control(sock)
        with self._lock:
            self._next = (self._next + 1) % (1 << 32)
            sender = _Sender(sock, self._next)
            self._senders[sender.number] = sender
        self._selector.register(sock, selectors.EVENT_READ, sender)
        log.info("control connection %d from %s", sender.number, peer)

    def _read(self, sender: _Sender) -> None:
        try:
            data = sender.sock.recv(_READ)
        except OSError:
            data = b""
        if not data:
            self._drop(sender, "closed by the peer")
            return
        sender.buffer += data
        # Bounded: each pass takes one frame off the buffer, or stops.
        while sender.buffer:
            try:
                decoded = decode_control(sender.buffer)
            except ValueError as err:
                self.malformed += 1
                log.warning("control connection %d: %s; closing it", sender.number, err)
                self._send(
                    sender, encode_control({"kind": "error", "code": 1, "message": str(err)})
                )
                self._drop(sender, "malformed frame")
                return
            if decoded is None:
                if len(sender.buffer) > _MAX_BUFFER:
                    self._drop(sender, "too much unread data")
                return
            message, used = decoded
            sender.buffer = sender.buffer[used:]
            if not self._handle(sender, message):
                return

    def _handle(self, sender: _Sender, m: dict) -> bool:
        kind = m["kind"]
        with self._lock:
            if kind == "request-to-send":
                self._apply(
                    self.scheduler.request(sender.number, m["id"], m["bytes"], m["slo_left_us"])
                )
                return True
            if kind == "done":  # from a sender: it will not send this message after all
                if self._granted.get(m["id"]) == sender.number:
                    del self._granted[m["id"]]
                self._apply(self.scheduler.withdraw(sender.number, m["id"]))
                return True
        text = f"control frame: a ranker takes request-to-send or done from a sender, got {kind}"
        self.malformed += 1
        log.warning("control connection %d: %s; closing it", sender.number, text)
        self._send(sender, encode_control({"kind": "error", "code": 3, "message": text}))
        self._drop(sender, "unexpected frame")
        return False

    def _apply(self, decisions) -> None:
        """Sends grants and expiries; holds the lock (called from the scheduler's calls)."""
        for what, number, message_id in decisions:
            sender = self._senders.get(number)
            if what == "grant":
                self._granted[message_id] = number
            if sender is not None:
                self._send(sender, encode_control({"kind": what, "id": message_id}))

    def _send(self, sender: _Sender, frame: bytes) -> None:
        try:
            sender.sock.sendall(frame)
        except OSError as err:
            log.warning("control connection %d: cannot send: %s", sender.number, err)

    def _drop(self, sender: _Sender, why: str) -> None:
        try:
            self._selector.unregister(sender.sock)
        except (KeyError, ValueError):
            pass
        with self._lock:
            sender.sock.close()
            self._senders.pop(sender.number, None)
            self._granted = {i: n for i, n in self._granted.items() if n != sender.number}
            self._apply(self.scheduler.sender_gone(sender.number))
        log.info("control connection %d: %s", sender.number, why)


class ControlledSource:
    """A batching loop's source whose received payloads free their incast window space as
    soon as they are read off their connections, not when the loop next asks (that waits for
    the batch being computed): a thread takes them from the wrapped source (the FrameServer)
    as they come, calls `complete` per item (keyed by its trace id, the id the router asked
    under) and queues them for `recv`. The rest is the wrapped source's. `close()` stops the
    thread."""

    _BATCH = 256  # items taken from the wrapped source at a time

    def __init__(self, source, control: ControlServer):
        self._source = source
        self._control = control
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="incast-receive", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        while not self._stop.is_set():
            try:
                items = self._source.recv(self._BATCH, _POLL_S)
            except Exception as err:  # the server closed under us: nothing more comes
                log.warning("incast receive thread stops: %s", err)
                return
            for item in items:
                if item[5]:
                    self._control.complete(item[5])
            if items:
                # Stamped as queued when the server queued them: `take` reports both waits.
                now = time.monotonic_ns()
                with self._cond:
                    self._items.extend((*item[:6], now - item[6]) for item in items)
                    self._cond.notify()

    def recv(self, max_items: int, timeout_s: float) -> list:
        return take(self._cond, self._items, max_items, timeout_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __getattr__(self, name):
        return getattr(self._source, name)
