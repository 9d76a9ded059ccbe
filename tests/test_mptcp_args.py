"""`transport: mptcp` and racks, without a testbed: the addresses roles are given, and the
rack options' bad input (docs/protocol.md "Multipath TCP", docs/testbed.md "Racks")."""

from __future__ import annotations

import argparse

import pytest
from cleave.errors import UsageError
from cleave.runners.roles import control_address, probe_base
from cleave.serve import _runner_options
from cleave.settings.addresses import listen_address, listen_host
from cleave.settings.choices import TRANSPORTS
from cleave.testbed.testbed import Testbed


def test_mptcp_is_a_transport_and_its_addresses_carry_the_prefix():
    assert "mptcp" in TRANSPORTS.names
    assert listen_address("mptcp", "198.18.0.11", 7000) == "mptcp:198.18.0.11:7000"
    assert listen_address("tcp", "198.18.0.11", 7000) == "198.18.0.11:7000"
    assert listen_host("mptcp:198.18.0.11:7000") == "198.18.0.11"
    assert listen_host("mptcp:[::1]:7000") == "::1"
    assert listen_host("unix:/tmp/s.sock") == "127.0.0.1"
    assert probe_base("mptcp:198.18.0.11:7000", 8000) == "http://198.18.0.11:8000"
    assert control_address("mptcp:[::1]:7000", 7400) == "[::1]:7400"
    assert control_address("10.0.0.1:7000", 7400) == "10.0.0.1:7400"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"racks": 4}, "must be a multiple of racks"),
        ({"racks": 0}, "racks must be an integer >= 1"),
        ({"racks": 2, "mode": "mesh"}, "mode must be one of tor, pool"),
        ({"racks": 2, "rack_gbit": [1.0]}, "one rate per rack"),
        ({"racks": 2, "rack_gbit": [1.0, -1.0]}, "rack_gbit must be > 0"),
        ({"rack_gbit": [1.0]}, "one rate per rack"),
    ],
)
def test_bad_rack_options_are_named(kwargs, message):
    with pytest.raises(UsageError, match=message):
        Testbed(6, 1.0, **kwargs)


def test_rack_flags_belong_to_the_testbed_runner():
    base = {"ray_address": None, "host": None, "link_gbit": None}
    with pytest.raises(UsageError, match="only with --runner testbed"):
        _runner_options(argparse.Namespace(runner="local", racks=2, rack_mode=None, **base), None)
    with pytest.raises(UsageError, match="--rack-mode: only with --racks"):
        _runner_options(
            argparse.Namespace(runner="testbed", racks=None, rack_mode="pool", **base), None
        )
    options = _runner_options(
        argparse.Namespace(runner="testbed", racks=2, rack_mode="pool", **base), None
    )
    assert options == {"link_gbit": 1.0, "racks": 2, "rack_mode": "pool"}
