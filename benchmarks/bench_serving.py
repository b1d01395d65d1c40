"""Serving benchmark: orchestrator overhead per request, and start-up against stock `vllm serve`.

    .venv/bin/python benchmarks/bench_serving.py [--requests 30] [--pipelines qwen_image,glm_image]

For each pipeline it starts the real `vllm serve TINY --stage-config <pipeline>_tiny.yaml`, sends
`--requests` sequential 64x64 / 2-step requests and reads two headers of each response:
x-omni-server-ms (the handler's end-to-end time) and x-omni-stage-ms (the sum of the stages'
own times, each from receipt of its request to its reply). Their difference is what the API
server + orchestrator add: validation, control messages, the stage hops, base64. Target: p50
<= 5 ms.

Start-up: the tiny GLM-Image deployment (AR + DiT stages) to its first healthy /health, against
stock `vllm serve` of its AR model alone (vision_language_encoder/ with --tokenizer processor/
and the AR stage's own engine settings from the YAML). Target: <= stock + 15 s.

For scale it also measures the machine's floor for one stage hop: a round trip of a small
pickled message between two idle processes over a socket pair (what every stage visit costs at
least; GLM-Image makes two per request, Qwen-Image one).

Prints a table and, last, one JSON line. Tiny models are built once under --models-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
VLLM = str(Path(sys.executable).parent / "vllm")
KINDS = {"qwen_image": "qwen-image", "glm_image": "glm-image"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model(pipeline: str, models_dir: Path) -> Path:
    out = models_dir / f"tiny-{KINDS[pipeline]}"
    if not (out / "model_index.json").exists():
        from vllm_omni_plugin.testing.tiny_models import build_tiny_model

        build_tiny_model(KINDS[pipeline], out, seed=0)
    return out


class Server:
    """One `vllm serve` process; the clock starts at spawn and stops at the first healthy /health."""

    def __init__(self, args: list[str], log: Path, extra_env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        env.update(extra_env or {})
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [VLLM, "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=open(log, "wb"),
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )

    def wait_healthy(self, timeout: float) -> float:
        while time.monotonic() - self.t0 < timeout:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace").splitlines()[-40:]
                raise RuntimeError("server exited:\n" + "\n".join(tail))
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.t0
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"not healthy within {timeout} s; log: {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure_overhead(server: Server, n: int, warmup: int) -> dict:
    body = {"prompt": "a lighthouse at dusk", "size": "64x64", "num_inference_steps": 2}
    overhead, server_ms, client_ms = [], [], []
    with httpx.Client(timeout=300) as client:
        for i in range(warmup + n):
            t0 = time.perf_counter()
            r = client.post(f"{server.url}/v1/images/generations", json={**body, "seed": i})
            took = (time.perf_counter() - t0) * 1e3
            r.raise_for_status()
            if i < warmup:
                continue
            total = float(r.headers["x-omni-server-ms"])
            stages = float(r.headers["x-omni-stage-ms"])
            overhead.append(total - stages)
            server_ms.append(total)
            client_ms.append(took)
    return {
        "requests": n,
        "overhead_ms_p50": round(statistics.median(overhead), 2),
        "overhead_ms_p90": round(pct(overhead, 0.9), 2),
        "server_ms_p50": round(statistics.median(server_ms), 1),
        "client_ms_p50": round(statistics.median(client_ms), 1),
    }


_ECHO = (
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "c = Connection(int(sys.argv[1]))\n"
    "while True:\n"
    "    c.send(c.recv())\n"
)


def hop_floor(n: int = 300) -> dict:
    """Round trip of a small message to an echoing process (the control path's floor)."""
    from multiprocessing.connection import Connection

    ours, theirs = socket.socketpair()
    child = subprocess.Popen(
        [sys.executable, "-c", _ECHO, str(theirs.fileno())], pass_fds=[theirs.fileno()]
    )
    theirs.close()
    conn = Connection(ours.detach())
    msg = {"request_id": "img-0", "params": {"prompt": "a lighthouse", "n": 1, "seed": 1}}
    times = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            conn.send(msg)
            conn.recv()
            times.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.005)  # let the peer go idle, as a stage does between requests
    finally:
        child.kill()
        conn.close()
    return {
        "hop_rtt_ms_p50": round(statistics.median(times), 3),
        "hop_rtt_ms_p90": round(pct(times, 0.9), 3),
    }


def stock_ar_args(glm_model: Path) -> tuple[list[str], dict[str, str]]:
    """`vllm serve` flags for the GLM-Image AR model alone, with the AR stage's engine settings
    (the stock scheduler: the comparison is about start-up, not scheduling), and the stage's env."""
    from vllm_omni_plugin.config import load_deploy_config

    cfg = load_deploy_config("glm_image_tiny", model=str(glm_model))
    ar = next(s for s in cfg.stages if s.kind == "ar")
    kwargs = ar.engine_kwargs()
    args = [str(kwargs.pop("model"))]
    for key in ("scheduler_cls", "async_scheduling"):
        kwargs.pop(key, None)
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + key.replace("_", "-"))
        else:
            args += [flag, str(value)]
    return args, dict(ar.env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pipelines", default="qwen_image,glm_image")
    parser.add_argument("--no-startup", action="store_true", help="skip the stock start-up run")
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/vllm-omni-plugin"))
    parser.add_argument("--startup-timeout", type=float, default=600)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    results: dict = {"machine": f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"}
    results["floor"] = hop_floor()

    for pipeline in [p for p in args.pipelines.split(",") if p]:
        model = tiny_model(pipeline, args.models_dir)
        config = REPO / "stage_configs" / f"{pipeline}_tiny.yaml"
        server = Server([str(model), "--stage-config", str(config)], logs / f"{pipeline}.log")
        try:
            startup = server.wait_healthy(args.startup_timeout)
            results[pipeline] = {
                "startup_s": round(startup, 1),
                **measure_overhead(server, args.requests, args.warmup),
            }
        finally:
            server.stop()

    if not args.no_startup and "glm_image" in results:
        model = tiny_model("glm_image", args.models_dir)
        flags, stage_env = stock_ar_args(model)
        stock = Server(flags, logs / "stock_ar.log", extra_env=stage_env)  # same env as the stage
        try:
            results["stock_ar_startup_s"] = round(stock.wait_healthy(args.startup_timeout), 1)
        finally:
            stock.stop()
        results["stock_ar_command"] = "vllm serve " + " ".join(flags)
        results["startup_delta_s"] = round(
            results["glm_image"]["startup_s"] - results["stock_ar_startup_s"], 1
        )

    print(
        f"{'pipeline':12s} {'overhead p50':>13s} {'p90':>8s} {'server p50':>11s} {'start-up':>9s}"
    )
    for pipeline in KINDS:
        if pipeline in results:
            r = results[pipeline]
            print(
                f"{pipeline:12s} {r['overhead_ms_p50']:10.2f} ms {r['overhead_ms_p90']:5.2f} ms "
                f"{r['server_ms_p50']:8.1f} ms {r['startup_s']:7.1f} s"
            )
    if "stock_ar_startup_s" in results:
        print(
            f"start-up: GLM-Image deployment {results['glm_image']['startup_s']} s, stock vllm "
            f"serve of its AR model {results['stock_ar_startup_s']} s "
            f"(delta {results['startup_delta_s']} s, target <= 15 s)"
        )
    floor = results["floor"]
    print(
        f"floor: one process round trip p50 {floor['hop_rtt_ms_p50']} ms, p90 {floor['hop_rtt_ms_p90']} ms"
    )
    print(f"logs: {logs}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
