"""A router process of its own per test, on shards and a ranker started once per module
(support.router's `Deployment`), and raw-socket HTTP/1.1 for the front-door tests: what the
client sends byte by byte and how the connection ends."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
from pathlib import Path

from cleave.launch.supervisor import find_executable

from support.client import request
from support.router import MODEL, Deployment, started

BOUND_S = 10.0  # every closure must happen within this


def backends(root: Path) -> Deployment:
    """Shards and a ranker under `root`, with the router settings that reach them (`base`)."""
    d = Deployment(root)
    d.root = root
    d.base = json.loads((root / "router.json").read_text())
    return d


class Router:
    """A router process of its own, on the module's shards and ranker."""

    def __init__(self, backends, **settings):
        config = {**backends.base, **settings}
        path = backends.root / f"router-{time.monotonic_ns()}.json"
        path.write_text(json.dumps(config))
        self.child = started("router", [find_executable("cleave-router"), str(path)])
        self.address = self.child.address
        host, port = self.address.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.url = f"{self.address}/v2/models/{MODEL}"

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc) -> None:
        self.child.stop()

    @property
    def grpc_address(self) -> str:
        """`HOST:PORT` of its gRPC door (given `grpc_port=0`), from its "listening" line."""
        for line in self.child.lines:
            m = re.search(r" grpc=(\S+)", line)
            if m:
                return m.group(1)
        raise AssertionError("no 'grpc=ADDR' line in:\n" + self.child.output())

    def connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=BOUND_S)
        sock.settimeout(BOUND_S)
        return sock

    def refuses_connections(self) -> bool:
        try:
            socket.create_connection((self.host, self.port), timeout=BOUND_S).close()
        # Reset: the connection was in the backlog of a listener that closed before accepting it.
        except (ConnectionRefusedError, ConnectionResetError):
            return True
        return False

    def metric(self, line_start: str) -> float:
        _, text = request(f"{self.address}/metrics")
        for line in text.splitlines():
            if line.startswith(line_start + " "):
                return float(line.split()[-1])
        raise AssertionError(f"no metric {line_start!r} in:\n{text}")


@contextlib.contextmanager
def kernel_stamping():
    """Holds a loopback pair whose reads the kernel stamps (`SO_TIMESTAMPING`, as the
    router's sockets ask), once it does: the kernel turns stamping on for every socket a
    moment after the first one asks and off when the last one closes, so a test that relies on
    the router's stamps holds this open around it."""
    so_timestamping, rx_software, software = 37, 1 << 3, 1 << 4
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.create_connection(listener.getsockname()) as client:
            server, _ = listener.accept()
            with server:
                server.setsockopt(socket.SOL_SOCKET, so_timestamping, rx_software | software)
                for _ in range(1000):
                    client.sendall(b".")
                    _, stamps, _, _ = server.recvmsg(64, 1024)
                    if stamps:
                        yield
                        return
                    time.sleep(0.001)
                raise AssertionError("the kernel never stamped a read")


def closed_within(sock: socket.socket, bound_s: float, trickle: bytes = b"") -> float:
    """Seconds until the server closed `sock` (EOF or reset), sending `trickle` one byte every
    0.25 s meanwhile; fails after `bound_s`."""
    start = time.monotonic()
    sock.settimeout(0.25)
    sent = 0
    while time.monotonic() - start < bound_s:
        try:
            if sent < len(trickle):
                sock.sendall(trickle[sent : sent + 1])
                sent += 1
            data = sock.recv(65536)
            if not data:
                return time.monotonic() - start
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - start
    raise AssertionError(f"connection still open after {bound_s} s")


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body: (status, headers, body)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a whole response head: {buf!r}"
        buf += chunk
    head, body = buf.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before the whole body"
        body += chunk
    return status, headers, body


def get(sock: socket.socket, path: str) -> tuple[int, dict[str, str], bytes]:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return read_response(sock)


def post_head(path: str, length: int, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()
