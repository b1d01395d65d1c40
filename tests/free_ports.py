"""Ports for the servers the tests start.

A port found by binding port 0 and closing the socket comes from the kernel's ephemeral range,
where every outgoing connection (ZMQ, NIXL, Ray, HTTP clients of the other test worker) also
takes its local port: between the check and the server's own bind, one of them can take it
("Address already in use" at the server's start). Ports here come from below that range, where
only an explicit bind lands, and each pytest-xdist worker has a block of its own, so the two
workers never hand out the same port. A port still held (a server of an earlier test, a socket
in TIME_WAIT) fails the bind check and is skipped.
"""

from __future__ import annotations

import itertools
import os
import random
import socket

# Above Ray's default worker ports (10002-19999); below the usual ephemeral start (32768).
FIRST, END = 20000, 32768
BLOCKS = 4  # xdist workers gw0..gw3 get blocks of their own; more share them in turn


def _block() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    size = (END - FIRST) // BLOCKS
    start = FIRST + (index % BLOCKS) * size
    return range(start, start + size)


def _ephemeral() -> range:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


_BLOCK = _block()
# Each process starts at a random place in its block: test processes of one worker that run
# one after another (a module's server, a subprocess's own helpers) seldom walk the same ports.
_START = random.randrange(len(_BLOCK))
_NEXT = itertools.cycle(itertools.chain(_BLOCK[_START:], _BLOCK[:_START]))


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    with socket.socket() as s:  # a server on all addresses holds it too
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing holds now, outside the kernel's ephemeral range."""
    ephemeral = _ephemeral()
    for _ in range(len(_BLOCK)):
        port = next(_NEXT)
        if port not in ephemeral and _bindable(port):
            return port
    raise RuntimeError(f"no free port in {_BLOCK.start}-{_BLOCK.stop - 1}")
