"""What a testbed deployment says about itself (docs/testbed.md)."""

from __future__ import annotations


def host_addresses(server) -> dict[str, str]:
    """Plan host name -> its testbed address, from the runner's "testbed 'NAME': h0=ADDR, …"
    line in a ServeProcess's log."""
    for line in server.log:
        _, sep, rest = line.partition("cleave serve: testbed ")
        if sep:
            pairs = rest.split(": ", 1)[1].split(", ")
            return dict(pair.split("=", 1) for pair in pairs)
    raise AssertionError("no testbed line in:\n" + "\n".join(server.log))
