"""Why a streamed edge's local channel is a Unix socket: one small message's round trip between
two processes, over a Unix socket vs through shared memory woken by an eventfd.

    python benchmarks/bench_edge_transport.py            # 64-byte messages (a codec frame)
    python benchmarks/bench_edge_transport.py --bytes 16384

A chunk of a streamed edge is tens of bytes (thinker ids, a codec frame of 16 ints) to tens of
KiB, so its cost is the wake-up of the other process, not the copy. Shared memory still needs
a wake-up (here the cheapest one, an eventfd); the round trip shows what is left to gain.
Prints the median round trip in microseconds over --repeats runs of --messages each, as JSON.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import statistics
import sys
import time


def socket_rtt(size: int, n: int) -> float:
    a, b = socket.socketpair()
    msg = b"x" * size
    pid = os.fork()
    if pid == 0:
        a.close()
        for _ in range(n):
            b.sendall(b.recv(size, socket.MSG_WAITALL))
        os._exit(0)
    b.close()
    t0 = time.perf_counter()
    for _ in range(n):
        a.sendall(msg)
        a.recv(size, socket.MSG_WAITALL)
    took = time.perf_counter() - t0
    os.waitpid(pid, 0)
    a.close()
    return took / n * 1e6


def shm_rtt(size: int, n: int) -> float:
    buf = mmap.mmap(-1, 2 * size)
    ping, pong = os.eventfd(0), os.eventfd(0)
    msg = b"x" * size
    pid = os.fork()
    if pid == 0:
        for _ in range(n):
            os.eventfd_read(ping)
            buf[size:] = buf[:size]
            os.eventfd_write(pong, 1)
        os._exit(0)
    t0 = time.perf_counter()
    for _ in range(n):
        buf[:size] = msg
        os.eventfd_write(ping, 1)
        os.eventfd_read(pong)
        bytes(buf[size:])
    took = time.perf_counter() - t0
    os.waitpid(pid, 0)
    os.close(ping)
    os.close(pong)
    return took / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bytes", type=int, default=64)
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    sock = [socket_rtt(args.bytes, args.messages) for _ in range(args.repeats)]
    shm = [shm_rtt(args.bytes, args.messages) for _ in range(args.repeats)]
    out = {
        "bytes": args.bytes,
        "unix_socket_rtt_us": round(statistics.median(sock), 1),
        "shm_eventfd_rtt_us": round(statistics.median(shm), 1),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
