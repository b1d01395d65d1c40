"""tests/free_ports.py: the ports the suite's servers get lie outside the kernel's ephemeral
range (where other processes' outgoing connections take theirs) and are free when handed out."""

from __future__ import annotations

import socket

from free_ports import _block, _ephemeral, free_port


def test_ports_are_free_distinct_and_outside_the_ephemeral_range():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    ephemeral, block = _ephemeral(), _block()
    for port in ports:
        assert port not in ephemeral and port in block
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_held_port_is_skipped():
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        assert taken not in {free_port() for _ in range(len(_block()))}


def test_each_xdist_worker_has_its_own_block(monkeypatch):
    blocks = []
    for worker in ("gw0", "gw1", "gw2", "gw3"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        blocks.append(set(_block()))
    assert all(a.isdisjoint(b) for i, a in enumerate(blocks) for b in blocks[i + 1 :])
