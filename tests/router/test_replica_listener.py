"""`router.replica_listener`: a Serve replica's wildcard internal listener moves to loopback, others stay."""

from __future__ import annotations

from router.replica_listener import loopback_address


def test_wildcard_hosts_move_to_loopback():
    assert loopback_address("[::]:0") == "127.0.0.1:0"
    assert loopback_address("0.0.0.0:4321") == "127.0.0.1:4321"
    assert loopback_address(":0") == "127.0.0.1:0"


def test_named_hosts_are_kept():
    assert loopback_address("10.0.0.7:0") == "10.0.0.7:0"
    assert loopback_address("[::1]:0") == "[::1]:0"
