"""An emulated multi-host testbed: N network namespaces ("hosts") on this machine, each joined
by a bandwidth-shaped veth pair to one bridge that the root namespace is also on.
docs/testbed.md describes what it emulates, its names and addresses, and its cleanup rules."""

from cleave.testbed.commands import TestbedError
from cleave.testbed.shaping import DEFAULT_BURST_KB, DEFAULT_QUEUE_KB
from cleave.testbed.testbed import Host, Testbed

__all__ = ["DEFAULT_BURST_KB", "DEFAULT_QUEUE_KB", "Host", "Testbed", "TestbedError"]
