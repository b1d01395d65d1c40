"""NIXL handoffs in GPU memory on one GPU, against a device-to-device copy.

    python benchmarks/bench_nixl_vram.py [--sizes 10K,64M] [--iters 50,20] [--device cuda:0]

Two processes share the GPU: this one produces, a spawned one consumes through a
`NixlConnector(device=...)`. A handoff is put + descriptor over a pipe + the consumer's READ into
its own GPU memory + release + an acknowledgement, timed on the producer (bench_connectors.py's
definition). Rows:
  - `cudaMemcpy d2d`: one process copies a tensor to another on the same GPU (torch `copy_`,
    then synchronize): the floor for moving the bytes at all;
  - `nixl vram->vram`: the producer's tensor lies in GPU memory and is registered there;
  - `nixl dram->vram`: the producer's tensor lies in host memory (how the AR stage's token ids
    leave vLLM), the consumer still reads straight into GPU memory.
The 10K row is the GLM-Image AR -> DiT payload at 1024x1024 (1281 int64 prior token ids).
The consumer checks every payload's checksum, so a row cannot report a transfer that did not
happen. Prints a table and a final JSON line. Runs on CPU too (`--device cpu`, both sides DRAM).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import statistics
import time
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch  # noqa: E402

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def summarize(times: list[float], nbytes: int) -> dict[str, float]:
    p50 = statistics.median(times)
    return {"p50_ms": p50 * 1e3, "min_ms": min(times) * 1e3, "gib_s": nbytes / p50 / 2**30}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_copy(nbytes: int, iters: int, device: torch.device) -> dict[str, float]:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(iters + 3):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    assert torch.equal(dst, src)
    return summarize(times[3:], nbytes)


def _consumer(pipe: Any, device: str) -> None:
    from vllm_omni_plugin.connectors import make_connector

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    conn = make_connector("nixl", name="vram-consumer", device=device)
    pipe.send_bytes(b"ready")
    while True:
        msg = pipe.recv_bytes()
        if msg == b"stop":
            break
        desc, checksum = pickle.loads(msg)
        payload = conn.get(desc, timeout=30)
        ok = payload.device.type == dev.type and int(payload.sum()) == checksum
        conn.release(desc)
        del payload
        pipe.send_bytes(b"ok" if ok else b"bad")
    conn.close()


def bench_nixl(
    nbytes: int, iters: int, source: torch.device, consumer_device: str, warmup: int = 3
) -> dict[str, float]:
    from vllm_omni_plugin.connectors import make_connector

    producer = make_connector("nixl", name="vram-producer", device=str(source))
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(there, consumer_device))
    proc.start()
    there.close()  # a consumer that dies then reads as EOF here, not as a hang

    def reply(timeout_s: float = 60) -> bytes:
        if not here.poll(timeout_s):
            raise TimeoutError(f"consumer silent for {timeout_s} s (alive: {proc.is_alive()})")
        return here.recv_bytes()

    try:
        assert reply(120) == b"ready"
        times = []
        for i in range(iters + warmup):
            payload = torch.full((nbytes,), i % 251, dtype=torch.uint8, device=source)
            checksum = int(payload.sum())
            sync(source)
            t = time.perf_counter()
            desc = producer.put("bench", 0, 1, payload)
            here.send_bytes(pickle.dumps((desc, checksum)))
            answer = reply()
            times.append(time.perf_counter() - t)
            if answer != b"ok":
                raise RuntimeError(f"consumer saw wrong bytes or device at handoff {i}")
            del payload
        here.send_bytes(b"stop")
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
        producer.close()
    return summarize(times[warmup:], nbytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10K,64M")
    parser.add_argument("--iters", default="50,20")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for nbytes, n in zip(
        [parse_size(s) for s in args.sizes.split(",")],
        [int(i) for i in args.iters.split(",")],
        strict=True,
    ):
        row: dict[str, dict[str, Any]] = {"cudaMemcpy d2d": bench_copy(nbytes, n, device)}
        for name, source in (("nixl vram->vram", device), ("nixl dram->vram", torch.device("cpu"))):
            try:
                row[name] = bench_nixl(nbytes, n, source, str(device))
            except Exception as e:  # report the failure in the table, keep the other rows
                row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        base = row["cudaMemcpy d2d"]["p50_ms"]
        for r in row.values():
            if "p50_ms" in r:
                r["x_d2d_time"] = r["p50_ms"] / base
        results[str(nbytes)] = row
    print(f"{'size':>10} {'path':<18} {'p50 ms':>9} {'min ms':>9} {'GiB/s':>8} {'x d2d time':>11}")
    for size, row in results.items():
        for name, r in row.items():
            if "error" in r:
                print(f"{int(size):>10} {name:<18} {r['error']}")
                continue
            print(
                f"{int(size):>10} {name:<18} {r['p50_ms']:>9.3f} {r['min_ms']:>9.3f}"
                f" {r['gib_s']:>8.2f} {r['x_d2d_time']:>11.1f}"
            )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(json.dumps({"bench": "nixl_vram", "device": name, "results": results}))


if __name__ == "__main__":
    main()
