"""Steady load for the served image benchmarks: a closed loop (N requests, C in flight, each
worker taking the next as soon as its last came back) or an open loop (Poisson arrivals at a
fixed rate, seeded), latency percentiles, and each response's own stage split.

Used by `bench_fair.py`; no GPU or server needed to import it.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

# One request: index -> its result (must carry "s", the client-side latency in seconds).
Send = Callable[[int], Awaitable[dict]]


@dataclass
class LoadResult:
    """What one load run measured."""

    mode: str  # "closed" or "open"
    requests: int
    concurrency: int | None  # closed loop: requests in flight
    rate_per_s: float | None  # open loop: mean arrival rate
    wall_s: float
    latencies_s: list[float]
    splits: list[dict[str, float]] = field(default_factory=list)

    def summary(self) -> dict:
        lat = sorted(self.latencies_s)
        out = {
            "mode": self.mode,
            "requests": self.requests,
            "completed": len(lat),
            "wall_s": round(self.wall_s, 2),
            "images_per_min": round(len(lat) * 60 / self.wall_s, 3) if self.wall_s > 0 else None,
            "p50_s": round(percentile(lat, 50), 2),
            "p99_s": round(percentile(lat, 99), 2),
            "mean_s": round(statistics.fmean(lat), 2),
        }
        if self.concurrency is not None:
            out["concurrency"] = self.concurrency
        if self.rate_per_s is not None:
            out["rate_per_s"] = self.rate_per_s
        if self.splits:
            out["split_median_s"] = median_split(self.splits)
        return out


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's
    default); needs at least one value."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def median_split(splits: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over the requests that reported it (seconds)."""
    keys = sorted({k for s in splits for k in s})
    return {
        k: round(statistics.median(s[k] for s in splits if k in s), 3)
        for k in keys
        if any(k in s for s in splits)
    }


async def closed_loop(send: Send, requests: int, concurrency: int) -> LoadResult:
    """`requests` requests through `concurrency` workers; each worker sends the next index as
    soon as its previous request came back. All must succeed (an exception propagates)."""
    if requests < 1 or concurrency < 1:
        raise ValueError("requests and concurrency must be >= 1")
    queue = iter(range(requests))
    results: list[dict] = []

    async def worker() -> None:
        for i in queue:  # a shared iterator: each index is taken once
            results.append(await send(i))

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(min(concurrency, requests))])
    wall = time.perf_counter() - t0
    return LoadResult(
        "closed", requests, concurrency, None, wall, [r["s"] for r in results], _splits(results)
    )


def arrival_times(requests: int, rate_per_s: float, seed: int) -> list[float]:
    """Poisson arrivals: cumulative exponential gaps with mean 1/rate, the first at 0."""
    if rate_per_s <= 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(requests):
        times.append(t)
        t += rng.expovariate(rate_per_s)
    return times


async def open_loop(send: Send, requests: int, rate_per_s: float, seed: int = 0) -> LoadResult:
    """`requests` requests sent at Poisson arrival times (mean rate `rate_per_s`), whether or
    not earlier ones came back; latency counts from each request's own arrival."""
    start = time.perf_counter()

    async def at(i: int, when: float) -> dict:
        await asyncio.sleep(max(0.0, start + when - time.perf_counter()))
        return await send(i)

    times = arrival_times(requests, rate_per_s, seed)
    results = await asyncio.gather(*[at(i, t) for i, t in enumerate(times)])
    wall = time.perf_counter() - start
    return LoadResult(
        "open", requests, None, rate_per_s, wall, [r["s"] for r in results], _splits(results)
    )


def _splits(results: list[dict]) -> list[dict[str, float]]:
    return [r["split_s"] for r in results if r.get("split_s")]


# ---- the stage split each system reports in its own response ----------------------------------
def split_from_response(headers, body: dict) -> dict[str, float]:
    """Where one request's time went, in seconds, as the serving system itself reported it.

    - vllm-omni-plugin: the `x-omni-stage-timings` header, milliseconds per key ("stage_0",
      "stage_1", "decode", "other"); an AR stage's "stage_<id>_ttft" / "stage_<id>_tpot" are
      parts of its stage's time, not more of the split, and stay out (ar_served.py reads them).
    - vLLM-Omni: the response body's `metrics.stage_durations`; keys ending in `_ms` are
      milliseconds (`stage_<id>_gen_ms`, each stage's generation time), the others seconds
      (its diffusion profiler's and the AR profiler's entries).
    Empty when the response carries neither (diffusers is timed in process instead).
    """
    raw = headers.get("x-omni-stage-timings") if headers is not None else None
    if raw:
        return {
            k: round(float(v) / 1e3, 4)
            for k, v in json.loads(raw).items()
            if not k.endswith(("_ttft", "_tpot"))
        }
    durations = ((body or {}).get("metrics") or {}).get("stage_durations") or {}
    out = {}
    for key, value in durations.items():
        if isinstance(value, (int, float)):
            out[key.removesuffix("_ms")] = round(
                float(value) / 1e3 if key.endswith("_ms") else float(value), 4
            )
    return out
