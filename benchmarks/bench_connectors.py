"""Stage-connector latency and bandwidth, side by side with memcpy and a loopback TCP socket.

    python benchmarks/bench_connectors.py [--sizes 32K,1M,64M] [--iters 200,50,10]

A "handoff" is what a stage pays per payload: producer put + descriptor over the control path
(a pipe) + consumer get + release + an acknowledgement back, timed on the producer. memcpy is one
process copying the bytes (into a reused buffer, and into a fresh one; "memcpy-hugepage" between
reused buffers on transparent huge pages, like the NIXL pools); TCP sends the bytes over a
loopback socket into a reused buffer and waits for the same acknowledgement. "nixl-pool" is the
NIXL connector with the payload built in its send pool (`NixlConnector.empty`), "nixl" with a
payload in ordinary memory (registered in place per put).

On a shared, loaded host the load changes between rows, so each connector row also times a plain
memcpy right before every handoff ("x memcpy@loop" = that memcpy's p50 / the handoff's p50): the
like-for-like ratio. Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import pickle
import socket
import statistics
import time
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import torch  # noqa: E402

from vllm_omni_plugin.connectors.staging import huge_page_buffer  # noqa: E402

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def summarize(times: list[float], nbytes: int) -> dict[str, float]:
    p50 = statistics.median(times)
    return {
        "p50_ms": p50 * 1e3,
        "p90_ms": sorted(times)[int(0.9 * (len(times) - 1))] * 1e3,
        "gib_s": nbytes / p50 / 2**30,
    }


def bench_memcpy(nbytes: int, iters: int) -> dict[str, dict[str, float]]:
    # libc memcpy through ctypes (one thread, like a transport's copy); torch's copy_ would use
    # its intra-op thread pool, which is slower than one thread on a busy 2-core host.
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
    reused, fresh = [], []
    for _ in range(iters):
        t = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        reused.append(time.perf_counter() - t)
        t = time.perf_counter()
        out = torch.empty(nbytes, dtype=torch.uint8)
        ctypes.memmove(out.data_ptr(), src.data_ptr(), nbytes)
        fresh.append(time.perf_counter() - t)
        del out
    huge_src, huge_dst = huge_page_buffer(nbytes), huge_page_buffer(nbytes)
    huge_src.copy_(src)
    huge_dst.fill_(0)
    huge = []
    for _ in range(iters):
        t = time.perf_counter()
        ctypes.memmove(huge_dst.data_ptr(), huge_src.data_ptr(), nbytes)
        huge.append(time.perf_counter() - t)
    return {
        "memcpy": summarize(reused, nbytes),
        "memcpy+alloc": summarize(fresh, nbytes),
        "memcpy-hugepage": summarize(huge, nbytes),
    }


# -- consumer processes ----------------------------------------------------------------------
def _connector_consumer(pipe: Any, kind: str) -> None:
    from vllm_omni_plugin.connectors import make_connector

    conn = make_connector(kind, name=f"bench-{kind}-consumer")
    pipe.send_bytes(b"ready")
    while True:
        msg = pipe.recv_bytes()
        if msg == b"stop":
            break
        desc = pickle.loads(msg)
        payload = conn.get(desc, timeout=30)
        conn.release(desc)
        del payload  # the receive slot returns to the pool before the next handoff
        pipe.send_bytes(b"ok")
    conn.close()


def _tcp_consumer(pipe: Any, port: int, nbytes: int, iters: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(nbytes)
    view = memoryview(buf)
    for _ in range(iters):
        got = 0
        while got < nbytes:
            got += sock.recv_into(view[got:], nbytes - got)
        sock.sendall(b"k")
    sock.close()


def bench_tcp(nbytes: int, iters: int) -> dict[str, float]:
    server = socket.create_server(("127.0.0.1", 0))
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_tcp_consumer, args=(there, server.getsockname()[1], nbytes, iters))
    proc.start()
    sock, _ = server.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = memoryview(
        bytes(os.urandom(min(nbytes, 1 << 16))) * (nbytes // min(nbytes, 1 << 16) + 1)
    )[:nbytes]
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        sock.sendall(data)
        sock.recv(1)
        times.append(time.perf_counter() - t)
    proc.join()
    sock.close()
    server.close()
    return summarize(times[1:] or times, nbytes)


def bench_connector(kind: str, nbytes: int, iters: int, warmup: int = 3) -> dict[str, float]:
    from vllm_omni_plugin.connectors import make_connector

    pooled = kind == "nixl-pool"
    kind = "nixl" if pooled else kind
    producer = make_connector(kind, name=f"bench-{kind}")
    base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(base)
    ctypes.memmove(dst.data_ptr(), base.data_ptr(), nbytes)
    times, copies = [], []
    if kind == "inproc":
        for _ in range(iters + warmup):
            t = time.perf_counter()
            desc = producer.put("bench", 0, 1, base)
            pickle.loads(pickle.dumps(desc))  # the control path still carries the descriptor
            producer.get(desc, timeout=30)
            producer.release(desc)
            times.append(time.perf_counter() - t)
    else:
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_connector_consumer, args=(there, kind))
        proc.start()
        assert here.recv_bytes() == b"ready"
        for _ in range(iters + warmup):
            # A fresh payload per request, made outside the timing.
            payload = producer.empty((nbytes,), torch.uint8) if pooled else torch.empty_like(base)
            ctypes.memmove(payload.data_ptr(), base.data_ptr(), nbytes)
            t = time.perf_counter()
            ctypes.memmove(dst.data_ptr(), base.data_ptr(), nbytes)
            copies.append(time.perf_counter() - t)
            t = time.perf_counter()
            desc = producer.put("bench", 0, 1, payload)
            here.send_bytes(pickle.dumps(desc))
            assert here.recv_bytes() == b"ok"
            times.append(time.perf_counter() - t)
            del payload
        here.send_bytes(b"stop")
        proc.join()
    producer.close()
    out = summarize(times[warmup:], nbytes)
    if copies:
        out["memcpy_at_loop_p50_ms"] = statistics.median(copies[warmup:]) * 1e3
        out["vs_memcpy_at_loop"] = out["memcpy_at_loop_p50_ms"] / out["p50_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32K,1M,64M")
    parser.add_argument("--iters", default="200,50,12")
    parser.add_argument("--kinds", default="inproc,shm,nixl,nixl-pool")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    iters = [int(i) for i in args.iters.split(",")]
    results: dict[str, dict[str, dict[str, float]]] = {}
    for nbytes, n in zip(sizes, iters, strict=True):
        row = bench_memcpy(nbytes, n)
        row["tcp-loopback"] = bench_tcp(nbytes, n)
        for kind in args.kinds.split(","):
            row[kind] = bench_connector(kind, nbytes, n)
        for r in row.values():
            r["vs_memcpy"] = r["gib_s"] / row["memcpy"]["gib_s"]
        results[str(nbytes)] = row
    head = f"{'size':>10} {'path':<16} {'p50 ms':>9} {'p90 ms':>9} {'GiB/s':>8} {'x memcpy':>9}"
    print(head + f" {'x memcpy@loop':>14}")
    for size, row in results.items():
        for name, r in row.items():
            at_loop = f"{r['vs_memcpy_at_loop']:>14.2f}" if "vs_memcpy_at_loop" in r else ""
            print(
                f"{int(size):>10} {name:<16} {r['p50_ms']:>9.3f} {r['p90_ms']:>9.3f}"
                f" {r['gib_s']:>8.2f} {r['vs_memcpy']:>9.2f} {at_loop}"
            )
    print(json.dumps({"bench": "connectors", "cpu_count": os.cpu_count(), "results": results}))


if __name__ == "__main__":
    main()
