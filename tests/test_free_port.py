"""agentrl.web.free_port: test and benchmark servers get ports outside the kernel's ephemeral range."""

from __future__ import annotations

import socket

from agentrl.web import _ephemeral_range, free_port


def test_a_free_port_is_below_the_ephemeral_range_and_bindable_with_its_span() -> None:
    """An ephemeral port freed by a stopped server can become the local port of any outgoing
    connection; a port below that range cannot, so a server restarted on it finds it free."""
    low, _ = _ephemeral_range()
    ports = {free_port(span=4) for _ in range(20)}
    assert len(ports) > 1  # drawn, not one fixed port for every caller
    for port in ports:
        assert 20000 <= port and port + 3 < low
        for p in range(port, port + 4):
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))


def test_a_port_someone_listens_on_is_never_returned() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        assert all(not (p <= taken < p + 4) for p in (free_port(span=4) for _ in range(200)))
