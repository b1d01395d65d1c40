"""Soak: many official-openai clients against the tiny GLM-Image and Qwen-Image servers.

    .venv/bin/python benchmarks/soak.py --duration 300 [--clients 64] [--out soak.json]

Loopback only, bounded in time: it starts `vllm serve TINY --stage-config <pipeline>_tiny.yaml`
for both pipelines (tiny models built once under --models-dir), or attaches to running ones
(--attach NAME=URL=PID, repeatable). `--clients` threads, spread over the servers, each with its
own `openai.OpenAI` client, send requests back to back until `--duration` is over: random sizes
(64 or 128 px a side), steps (1-3), n (1-2), seeds, response formats (b64_json, url),
output formats (png, jpeg, webp), one in five streamed (partial_images 0-2). A fraction of the
clients (`--disconnect-fraction`) hang up mid-request (a client timeout shorter than the
request, or closing a stream after its first event): those are deliberate and counted apart.
No request starts after --duration; one still running 20 s later is cut (the client leaves)
and counted as cut, so a run ends within --duration + 20 s plus the drain.

Report (a table, then one JSON line): requests done, errors by kind (must be 0 besides the
deliberate disconnects), latency p50/p99 of completed requests, per server the RSS and open
file descriptors of the API server and every stage process at start (after a warm-up) and at
the end (after the in-flight requests drained), stage restarts/deaths/stalls during the run
(must be 0), and what the stages still hold at the end (must be nothing: every disconnected
request was dropped in every stage). Growth bound: RSS at most +25 % + 256 MiB over the start,
open fds at most +64 (connection churn); `ok` is false when any bound or zero above is broken.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_serving import Server, tiny_model  # noqa: E402

API_KEY = "soak-key"
RSS_GROWTH = (0.25, 256 << 20)  # (fraction, bytes): allowed end RSS = start * 1.25 + 256 MiB
FD_GROWTH = 64
GRACE_S = 20.0  # after --duration, requests still running get this long to finish
SIZES = ("64x64", "128x128")


@dataclass
class Target:
    """One server under soak: its name (pipeline), URL, model and the pid of `vllm serve`."""

    name: str
    url: str
    model: str
    pid: int
    api_key: str = API_KEY


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    disconnects: int = 0
    cut: int = 0  # still running at the end of the grace period: the client left
    done: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def processes(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def footprint(pid: int) -> dict:
    """RSS (bytes) and open fds of the server and all its descendants (stage processes, vLLM's
    engine core and workers), summed, and how many processes that is."""
    rss = fds = count = 0
    for p in processes(pid):
        try:
            rss += p.memory_info().rss
            fds += p.num_fds()
            count += 1
        except psutil.Error:  # gone meanwhile
            pass
    return {"rss_bytes": rss, "open_fds": fds, "processes": count}


def stage_counters(t: Target) -> dict:
    """omni_stage_{restarts,deaths,stalls} summed over stages, and requests still in flight,
    from /metrics."""
    text = httpx.get(f"{t.url}/metrics", timeout=30).text
    out = Counter()
    for line in text.splitlines():
        for name in ("restarts", "deaths", "stalls", "requests_in_flight"):
            metric = f"omni_stage_{name}"
            if line.startswith((metric + "{", metric + "_total{")):
                out[name] += float(line.split()[-1])
    return dict(out)


def stages_hold(t: Target) -> dict | None:
    """What each stage's engine still holds (GET /v1/omni/stages?live=1; None when the
    server does not expose the route: VLLM_OMNI_DESCRIBE_STAGES unset)."""
    r = httpx.get(
        f"{t.url}/v1/omni/stages",
        params={"live": "1"},
        headers={"Authorization": f"Bearer {t.api_key}"},
        timeout=60,
    )
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return {
        s["stage_id"]: sorted((s["live"] or {}).get("requests", {})) for s in r.json()["stages"]
    }


def one_request(client, t: Target, rng: random.Random, hang_up: bool, limit_s: float) -> None:
    """One random request; raises on failure. A hang-up makes the client leave mid-request;
    otherwise the client gives up after `limit_s` (the end of the run's grace period)."""
    kw = {
        "model": t.model,
        "prompt": rng.choice(["a red bicycle", "a lighthouse at dusk", "two cats on a sofa"]),
        "size": rng.choice(SIZES),
        "n": rng.choice([1, 1, 2]),
        "extra_body": {"seed": rng.randrange(1 << 31), "num_inference_steps": rng.randint(1, 3)},
    }
    if rng.random() < 0.2:  # streamed
        kw["extra_body"]["partial_images"] = rng.randint(0, 2)
        # The client's timeout is per read, and the server's keep-alive comments reset it:
        # a timer closes the stream at the end of the grace period.
        ends = time.monotonic() + limit_s
        stream = client.images.generate(**kw, stream=True, timeout=limit_s)
        timer = threading.Timer(limit_s, stream.response.close)
        timer.start()
        completed = 0
        try:
            for event in stream:
                if hang_up:
                    stream.response.close()  # leave after the first event
                    raise HungUp
                if event.type == "image_generation.completed":
                    assert base64.b64decode(event.b64_json)
                    completed += 1
        except HungUp:
            raise
        except Exception:
            if time.monotonic() >= ends - 0.1:
                raise Cut from None
            raise
        finally:
            timer.cancel()
        if completed < kw["n"] and time.monotonic() >= ends - 0.1:
            raise Cut
        assert completed == kw["n"], completed
        return
    fmt = rng.choice(["b64_json", "url"])
    res = client.images.generate(
        **kw,
        response_format=fmt,
        output_format=rng.choice(["png", "jpeg", "webp"]),
        timeout=rng.uniform(0.05, 0.5) if hang_up else limit_s,
    )
    assert len(res.data) == kw["n"]
    for d in res.data:
        if fmt == "url":
            got = httpx.get(d.url, headers={"Authorization": f"Bearer {t.api_key}"}, timeout=60)
            assert got.status_code == 200 and got.content, got.status_code
        else:
            assert base64.b64decode(d.b64_json)


class HungUp(Exception):
    """A deliberate disconnect."""


class Cut(Exception):
    """Still running at the end of the grace period: the client left."""


def client_loop(
    t: Target, seed: int, deadline: float, grace_s: float, disconnects: bool, tally: Tally
) -> None:
    """Requests back to back until `deadline`; one still running `grace_s` after it is cut
    (the client leaves, like a hang-up) and counted as cut, so the run stays bounded."""
    import openai

    client = openai.OpenAI(base_url=f"{t.url}/v1", api_key=t.api_key, max_retries=0, timeout=600)
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        hang_up = disconnects and rng.random() < 0.5
        t0 = time.monotonic()
        try:
            one_request(client, t, rng, hang_up, max(0.5, deadline + grace_s - t0))
        except HungUp:
            with tally.lock:
                tally.disconnects += 1
            continue
        except Cut:
            with tally.lock:
                tally.cut += 1
            continue
        except openai.APITimeoutError:
            if hang_up or time.monotonic() >= deadline + grace_s - 0.5:
                with tally.lock:
                    if hang_up:
                        tally.disconnects += 1
                    else:
                        tally.cut += 1
                continue
            kind = "timeout"
        except openai.APIStatusError as exc:
            kind = f"http_{exc.status_code}"
        except Exception as exc:  # noqa: BLE001 - every failure is counted by kind
            kind = type(exc).__name__
        else:
            with tally.lock:
                tally.done += 1
                tally.latencies.append(time.monotonic() - t0)
            continue
        with tally.lock:
            tally.errors[f"{t.name}:{kind}"] += 1


def drain(t: Target, timeout_s: float = 120.0) -> None:
    """Wait until no request is in flight in any stage (the last ones finish or are dropped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stage_counters(t).get("requests_in_flight", 0) == 0:
            return
        time.sleep(0.5)


def warm_up(t: Target) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{t.url}/v1", api_key=t.api_key, max_retries=0)
    for size in SIZES:
        client.images.generate(model=t.model, prompt="warm", size=size, extra_body={"seed": 0})


def run_soak(
    targets: list[Target],
    duration_s: float,
    clients: int,
    disconnect_fraction: float,
    seed: int,
    grace_s: float = GRACE_S,
) -> dict:
    for t in targets:
        warm_up(t)
    start = {t.name: footprint(t.pid) for t in targets}
    counters0 = {t.name: stage_counters(t) for t in targets}
    tally = Tally()
    rng = random.Random(seed)
    deadline = time.monotonic() + duration_s
    n_disc = round(clients * disconnect_fraction)
    threads = [
        threading.Thread(
            target=client_loop,
            args=(
                targets[i % len(targets)],
                rng.randrange(1 << 31),
                deadline,
                grace_s,
                i < n_disc,
                tally,
            ),
            daemon=True,
        )
        for i in range(clients)
    ]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - t0
    servers = {}
    ok = not tally.errors and tally.done > 0
    for t in targets:
        drain(t)
        time.sleep(2.0)  # closed connections and finished requests release their fds
        end = footprint(t.pid)
        c1 = stage_counters(t)
        changes = {
            k: c1.get(k, 0) - counters0[t.name].get(k, 0) for k in ("restarts", "deaths", "stalls")
        }
        held = stages_hold(t)
        rss_bound = start[t.name]["rss_bytes"] * (1 + RSS_GROWTH[0]) + RSS_GROWTH[1]
        fd_bound = start[t.name]["open_fds"] + FD_GROWTH
        within = end["rss_bytes"] <= rss_bound and end["open_fds"] <= fd_bound
        left = held is not None and any(held.values())
        ok = ok and within and not any(changes.values()) and not left
        servers[t.name] = {
            "start": start[t.name],
            "end": end,
            "rss_bound_bytes": int(rss_bound),
            "fd_bound": fd_bound,
            "within_bounds": within,
            "stage_changes": changes,
            "still_held_by_stages": held,
            "in_flight_at_end": c1.get("requests_in_flight", 0),
        }
    lat = sorted(tally.latencies)
    return {
        "ok": ok,
        "duration_s": round(wall, 1),
        "clients": clients,
        "disconnecting_clients": n_disc,
        "requests_done": tally.done,
        "deliberate_disconnects": tally.disconnects,
        "cut_at_end": tally.cut,
        "errors": dict(tally.errors),
        "latency_p50_s": round(statistics.median(lat), 3) if lat else None,
        "latency_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
        "servers": servers,
    }


def print_report(report: dict) -> None:
    print(
        f"{report['duration_s']} s, {report['clients']} clients "
        f"({report['disconnecting_clients']} hang up at times): "
        f"{report['requests_done']} done, {report['deliberate_disconnects']} deliberate "
        f"disconnects, {report['cut_at_end']} cut at the end, errors {report['errors'] or 0}, "
        f"p50 {report['latency_p50_s']} s, p99 {report['latency_p99_s']} s"
    )
    for name, s in report["servers"].items():
        a, b = s["start"], s["end"]
        print(
            f"  {name}: RSS {a['rss_bytes'] / 2**20:.0f} -> {b['rss_bytes'] / 2**20:.0f} MiB "
            f"(bound {s['rss_bound_bytes'] / 2**20:.0f}), fds {a['open_fds']} -> "
            f"{b['open_fds']} (bound {s['fd_bound']}), {b['processes']} processes, "
            f"stage changes {s['stage_changes']}, still held {s['still_held_by_stages']}"
        )
    print("ok" if report["ok"] else "NOT OK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--disconnect-fraction", type=float, default=0.125)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "omni-soak")
    ap.add_argument(
        "--attach",
        action="append",
        default=[],
        help="NAME=URL=PID of a running server (instead of starting both)",
    )
    ap.add_argument("--api-key", default=API_KEY, help="of the --attach servers")
    ap.add_argument("--out", type=Path, help="also write the JSON report here")
    args = ap.parse_args()
    servers: list[Server] = []
    targets: list[Target] = []
    try:
        if args.attach:
            for spec in args.attach:
                name, url, pid = spec.split("=")
                model = httpx.get(
                    f"{url}/v1/models", headers={"Authorization": f"Bearer {args.api_key}"}
                ).json()["data"][0]["id"]
                targets.append(Target(name, url, model, int(pid), args.api_key))
        else:
            args.models_dir.mkdir(parents=True, exist_ok=True)
            for pipeline in ("glm_image", "qwen_image"):
                model = tiny_model(pipeline, args.models_dir)
                server = Server(
                    [
                        str(model),
                        "--stage-config",
                        str(REPO / "stage_configs" / f"{pipeline}_tiny.yaml"),
                        "--api-key",
                        API_KEY,
                    ],
                    args.models_dir / f"soak-{pipeline}.log",
                    extra_env={"VLLM_OMNI_DESCRIBE_STAGES": "1"},
                )
                servers.append(server)
                server.wait_healthy(900)
                targets.append(Target(pipeline, server.url, str(model), server.proc.pid))
        report = run_soak(targets, args.duration, args.clients, args.disconnect_fraction, args.seed)
    finally:
        for server in servers:
            server.stop()
    print_report(report)
    print(json.dumps(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
