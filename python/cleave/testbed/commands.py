"""Running ``ip`` and ``tc``: every failure becomes a TestbedError naming the command and its
stderr, and every call is bounded in time."""

from __future__ import annotations

import shlex
import shutil
import subprocess

from cleave.errors import CleaveError, UsageError

TIMEOUT_S = 20.0  # one ip/tc call; a kernel that takes longer is wedged, not slow
CAP_NET_ADMIN = 12  # bit in CapEff (linux/capability.h)


class TestbedError(CleaveError):
    """A network operation of the testbed failed: names the command and what it printed."""

    __test__ = False  # not a pytest test class despite the name


def run_tool(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    """Run one ip/tc command; raise TestbedError (command + stderr) when it fails and check."""
    cmd = shlex.join(argv)
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError:
        raise TestbedError(f"`{cmd}`: {argv[0]} is not installed (iproute2 is needed)") from None
    except subprocess.TimeoutExpired:
        raise TestbedError(f"`{cmd}` did not finish within {TIMEOUT_S:.0f} s") from None
    if check and proc.returncode != 0:
        stderr = proc.stderr.strip() or "(no stderr)"
        raise TestbedError(f"`{cmd}` failed with exit code {proc.returncode}: {stderr}")
    return proc


def ip(*args: str, check: bool = True) -> str:
    return run_tool(["ip", *args], check=check).stdout


def tc(*args: str, check: bool = True) -> str:
    return run_tool(["tc", *args], check=check).stdout


def has_net_admin() -> bool:
    """Whether this process holds CAP_NET_ADMIN in its effective set."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
    except OSError:
        pass
    return False


def require_privileges() -> None:
    """UsageError unless namespaces can be made here: CAP_NET_ADMIN and iproute2 present."""
    if not has_net_admin():
        raise UsageError(
            "the testbed needs CAP_NET_ADMIN to create network namespaces, veths and qdiscs; "
            "this process does not hold it (run as root or grant the capability)"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise UsageError(f"the testbed needs iproute2; not found on PATH: {', '.join(missing)}")


def unavailable() -> str | None:
    """Why no testbed can be made here (what `require_privileges` would say), or None."""
    try:
        require_privileges()
    except UsageError as err:
        return str(err)
    return None
