"""A fork server for the Python roles (rankers): one process imports what a ranker needs once,
and each ranker is forked from it instead of starting an interpreter of its own.

Why: importing torch is most of a ranker's start (about 2 s of CPU on the AMD EPYC here). A
model version loaded under load starts its rankers on the cores that serve, and on one core
that start slowed the serving ranker enough to refuse requests (docs/benchmarks.md, "A load
under load on one core, with forked rankers"). A forked ranker shares the imported pages,
and a version loads in a tenth of the time.
Nothing is imported that starts threads we would fork: torch's thread pools start at its
first operation, which the server never runs.

The protocol, over a Unix SEQPACKET socket pair the supervisor made (nobody else can connect):

* supervisor -> server: a JSON object `{"argv": [...], "env": {...}, "cwd": "..."}` with two
  descriptors (the child's stdout and stderr); `argv` is what follows the interpreter on a
  command line, `-m MODULE ARGS...`: the child runs MODULE as `python -m` would.
* server -> supervisor: `{"pid": N}` with the child's pidfd, or `{"error": "..."}`, in order;
  and `{"exit": N, "code": C}` when child N ends (C as `Popen.returncode`: negative for a
  signal).

`CLEAVE_FORK=0` in the supervisor's environment turns it off: each role starts its own
interpreter, as before (a diagnostic switch; docs/serving.md)."""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import queue
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
import traceback

from cleave.errors import CleaveError

# What a ranker imports before it serves (cleave/ranker/cli.py's run()), by name: this
# module only preloads them, the child runs its command line's module.
PRELOAD = (
    "torch",
    "cleave._native",
    "cleave.ranker.program",
    "cleave.ranker.probes",
    "cleave.ranker.control",
)
_MAX_MESSAGE = 1 << 20  # a request's JSON: an argv and an environment
# Room the server's command line keeps for its children's (see _show_argv).
_ARGV_ROOM = 8192
_START_TIMEOUT_S = 120.0  # the server's imports, on a loaded machine


def enabled() -> bool:
    """Unless `CLEAVE_FORK=0`, where the kernel gives pidfds (Linux 5.3)."""
    if os.environ.get("CLEAVE_FORK", "1") == "0" or not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


def die_with_parent() -> None:
    """In a new child: SIGKILL it when its parent dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


# -- the supervisor's side --------------------------------------------------------------------


class ForkedProcess:
    """What the supervisor needs of a `subprocess.Popen`, for a child of the fork server: its
    exit code comes from the server, its signals go through a pidfd (never to a reused pid)."""

    def __init__(self, pid: int, pidfd: int):
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = self.stderr = None
        self._exited = threading.Event()
        self._lock = threading.Lock()
        self._pidfd = pidfd  # opened by the server before it could reap the child

    def _ended(self, code: int) -> None:
        with self._lock:
            if self.returncode is None:
                self.returncode = code
                os.close(self._pidfd)
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self.returncode is None:
                try:
                    signal.pidfd_send_signal(self._pidfd, sig)
                except ProcessLookupError:  # exited; the server's word is on its way
                    pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The supervisor's handle on one fork server: started here (its imports take a couple of
    seconds), then `spawn` any number of children."""

    def __init__(self, wrap: list[str] | None = None, log=None):
        """`wrap`: what runs it (`ip netns exec HOST`, say); its children inherit where it
        runs. `log`: called with each line the server itself writes (an import's warning)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        own = [sys.executable, "-m", __name__, str(theirs.fileno()), "." * _ARGV_ROOM]
        self.proc = subprocess.Popen(
            [*(wrap or []), *own],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            pass_fds=[theirs.fileno()],
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()  # one request at a time: replies come in order
        self._replies: queue.Queue = queue.Queue()
        self._children: dict[int, ForkedProcess] = {}
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._echo, args=(log or print,), daemon=True).start()
        reply = self._reply(_START_TIMEOUT_S)
        if reply.get("ready") is not True:
            self.close()
            raise CleaveError(f"the fork server did not start: {reply.get('error', reply)}")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str) -> ForkedProcess:
        """Forks a child that runs `python ARGV` (`-m MODULE ARGS...`) with this environment,
        in this directory; its stdout and stderr are the returned process's text streams."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
        try:
            with self._lock:
                try:
                    socket.send_fds(self._sock, [request], [out_w, err_w])
                except OSError as err:
                    raise CleaveError(f"the fork server is gone ({err})") from None
                reply = self._reply(_START_TIMEOUT_S)
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        if "pid" not in reply:
            os.close(out_r)
            os.close(err_r)
            raise CleaveError(f"the fork server could not start {argv[:1]}: {reply.get('error')}")
        proc = reply["process"]
        proc.stdout = open(out_r, encoding="utf-8", errors="replace")
        proc.stderr = open(err_r, encoding="utf-8", errors="replace")
        return proc

    def _reply(self, timeout: float) -> dict:
        try:
            return self._replies.get(timeout=timeout)
        except queue.Empty:
            raise CleaveError(f"the fork server did not answer in {timeout:.0f} s") from None

    def _echo(self, log) -> None:
        for line in self.proc.stdout:
            log(line.rstrip("\n"))

    def _read(self) -> None:
        """Replies to the waiting request; children's exits to their processes. When the
        server is gone, so are its children (each dies with it: PR_SET_PDEATHSIG)."""
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(self._sock, _MAX_MESSAGE, 1)
            except OSError:
                message, fds = b"", []
            if not message:
                break
            reply = json.loads(message)
            if "exit" in reply:
                proc = self._children.pop(reply["exit"], None)
                if proc is not None:
                    proc._ended(reply["code"])
                continue
            if "pid" in reply:  # registered before its exit can arrive
                proc = self._children[reply["pid"]] = ForkedProcess(reply["pid"], fds[0])
                reply["process"] = proc
            self._replies.put(reply)
        self._replies.put({"error": f"the fork server ended ({self.proc.wait()})"})
        for proc in list(self._children.values()):
            proc._ended(-signal.SIGKILL)
        self._children.clear()

    def close(self) -> None:
        """Ends the server (its children die with it: stop them first)."""
        self._sock.close()
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait()


# -- the server -------------------------------------------------------------------------------


def _show_argv(argv: list[str]) -> None:
    """Rewrites this process's command line, as /proc/PID/cmdline (and so `ps`, and whatever
    finds a role by its arguments) shows it: a forked ranker shows the command line it would
    have had as an interpreter of its own. The server was started with room for it (Python
    keeps copies of its arguments, not the originals, which this overwrites)."""
    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
    except (OSError, IndexError, ValueError):
        return
    shown = "\0".join(argv).encode(errors="replace")[: end - start - 1]
    ctypes.memmove(start, shown.ljust(end - start, b"\0"), end - start)


def _request(message: bytes, fds: list[int]) -> tuple[list[str], dict[str, str], str]:
    expected = (
        'expected a JSON object {"argv": ["-m", module, strings...], "env": {string: string}, '
        '"cwd": string} with two file descriptors'
    )
    try:
        request = json.loads(message)
        argv, env, cwd = request["argv"], request["env"], request["cwd"]
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"{expected}; got {message[:200]!r} ({err})") from None
    ok = (
        isinstance(argv, list)
        and len(argv) >= 2
        and argv[0] == "-m"
        and all(isinstance(a, str) for a in argv)
        and isinstance(env, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        and isinstance(cwd, str)
    )
    if not ok or len(fds) != 2:
        raise ValueError(f"{expected}; got {message[:200]!r} and {len(fds)} descriptors")
    return argv, env, cwd


def _child(argv: list[str], env: dict[str, str], cwd: str, fds: list[int], parent: int) -> None:
    """In the forked child: become the role, as a fresh interpreter would; never returns."""
    code = 1
    try:
        os.setsid()
        die_with_parent()
        if os.getppid() != parent:  # the server died before we asked to die with it
            os._exit(1)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((devnull, 0), (fds[0], 1), (fds[1], 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        _show_argv([sys.executable, *argv])
        sys.argv = [argv[1], *argv[2:]]  # as `python -m` sets it (runpy puts the path first)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        if isinstance(exit_.code, int) or exit_.code is None:
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code if isinstance(code, int) else 1)


def serve(fd: int) -> int:
    """The server's loop: fork on each request, report each child's exit; ends when the
    supervisor's end of the socket closes."""
    try:
        return _serve(fd)
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the supervisor is gone; the children die with us


def _serve(fd: int) -> int:
    sock = socket.socket(fileno=fd)
    _show_argv([sys.executable, "-m", __spec__.name, str(fd)])
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    except Exception as err:  # said to the supervisor, which names it
        sock.send(json.dumps({"error": f"importing {name}: {err}"}).encode())
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to act on
    wake_r, wake_w = socket.socketpair()
    for s in (wake_r, wake_w):
        s.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select() through the fd
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    sock.send(b'{"ready": true}')
    while True:
        for key, _ in selector.select():
            if key.fileobj is wake_r:
                while True:
                    try:
                        if not wake_r.recv(512):
                            break
                    except BlockingIOError:
                        break
                _reap(sock)
                continue
            try:
                message, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
            except OSError:
                return 0
            if not message:
                return 0  # the supervisor is gone; the children die with us
            try:
                argv, env, cwd = _request(message, fds)
            except ValueError as err:
                for fd in fds:
                    os.close(fd)
                sock.send(json.dumps({"error": str(err)}).encode())
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            server = os.getpid()
            pid = os.fork()
            if pid == 0:
                sock.close()
                wake_r.close()
                wake_w.close()
                _child(argv, env, cwd, fds, server)
            for fd in fds:
                os.close(fd)
            pidfd = os.pidfd_open(pid)  # before _reap: it names this child, never a reused pid
            try:
                socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [pidfd])
            finally:
                os.close(pidfd)
            _reap(sock)  # a child may have ended while we forked


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1])))
