"""GLM-Image on two GPUs of one host: the AR stage on a head, the DiT on a headless node.

    python benchmarks/bench_two_gpu_glm.py headless --model DIR --out OUT [--size 1024 --steps 50]
    # CPU check: the tiny model, NIXL over lo, a long request (256x256, 200 steps) to kill
    python benchmarks/bench_two_gpu_glm.py headless --model /tmp/glm-tiny --out OUT \
        --stage-config glm_image_tiny_nixl --size 64 --steps 2 --kill-size 256 --kill-steps 200

Starts the head (`vllm serve DIR --stage-config CFG --stage-ids 0 --omni-master-port M`: API
server + AR, GPU 0 by the config's `devices`) and the node (`... --headless --stage-ids 1
--omni-master-address 127.0.0.1 --omni-master-port M`: DiT, GPU 1) as two process groups, logs in
OUT. Records (one line in OUT/results.jsonl): seconds to a healthy /health; one request (seconds,
x-omni-stage-timings split), then --repeats more (warm: no first-request costs); the node
SIGKILLed mid-request (seconds to the answer: 503 expected; /health right after: 503; the head
alive); the node restarted (seconds to healthy; one request: 200; stage 1 deaths and restarts on
/metrics: +1 each). Peak memory per GPU up to the warm requests. Exit 1 when an expectation failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
from bench_gpu_glm import (
    PeakMemory,
    Server,
    _keep_log_lines,
    _one,
    _record,
    _versions,
    free_port,
    record_group,
)

# As tests/multinode/test_headless_loopback.py: head and node share one host, so UCX (NIXL
# configs) runs over lo; a small CPU KV cache. VLLM_OMNI_AUTHKEY is required off loopback only
# (docs/multi-node.md); a real key runs the handshake as two hosts would. Caller's env wins.
for key, value in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "UCX_NET_DEVICES": "lo",
    "NIXL_LOG_LEVEL": "WARN",
    "VLLM_OMNI_AUTHKEY": secrets.token_hex(16),
}.items():
    os.environ.setdefault(key, value)


def _tree(pid: int, seen: set) -> list[psutil.Process]:
    """`pid` and all below it. Stage processes run in sessions of their own, out of reach of a
    process-group kill: `seen` keeps every one found, so that none outlives the run."""
    try:
        root = psutil.Process(pid)
        found = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        found = []
    seen.update(found)
    return found


def _kill(procs) -> None:
    for p in procs:
        try:
            p.send_signal(signal.SIGCONT)  # as tests/multinode/cluster.py Proc.kill_all
            p.kill()
        except psutil.NoSuchProcess:
            pass


class Node:
    """The headless node. It runs no HTTP server (it dials the head's node registry): none of
    Server's --host/--port."""

    def __init__(self, argv: list[str], log: Path):
        vllm = str(Path(sys.executable).parent / "vllm")
        vllm = vllm if Path(vllm).exists() else "vllm"
        self.log, self.seen = log, set()
        self.proc = subprocess.Popen(
            [vllm, "serve", *argv],
            stdout=open(log, "wb"),
            stderr=subprocess.STDOUT,
            cwd=tempfile.gettempdir(),  # as Server: the checkout would shadow the installed package
            start_new_session=True,
        )
        record_group(self.proc.pid)

    def stop(self) -> None:
        _tree(self.proc.pid, self.seen)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        _kill(self.seen)
        self.proc.wait(30)


def _wait_health(head: Server, node: Node, timeout: float) -> float:
    """Seconds until the head's /health answers 200; fails at once when either process exits."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for name, p, log in (("head", head.proc, head.log), ("node", node.proc, node.log)):
            if p.poll() is not None:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
                raise RuntimeError(f"{name} exited ({p.returncode}):\n{tail}")
        try:
            if httpx.get(f"{head.url}/health", timeout=2).status_code == 200:
                return round(time.monotonic() - t0, 1)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"/health not 200 within {timeout} s")


def _stage1(head: Server, name: str) -> float | None:
    for line in httpx.get(f"{head.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and 'stage_id="1"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def _request(head: Server, args, i: int) -> dict:
    """One image through the official client: status, seconds, stage split (s), error body."""
    import openai

    async def go() -> dict:
        url = f"{head.url}/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="-", timeout=600, max_retries=0) as c:
            return await _one(c, args, i, {"guidance_scale": 1.5})  # as bench_gpu_glm.py sends

    t0 = time.monotonic()
    try:
        r = asyncio.run(go())
    except openai.APIStatusError as e:  # .body: the answer's "error" object
        return {"status": e.status_code, "s": round(time.monotonic() - t0, 2), "error": e.body}
    except openai.APIConnectionError as e:  # no answer at all (a timeout, a dropped connection)
        return {"status": None, "s": round(time.monotonic() - t0, 2), "error": repr(e)}
    split = {k: round(v / 1e3, 2) for k, v in (r["timings"] or {}).items()}
    return {"status": 200, "s": round(r["s"], 2), "split_s": split}


def phase_headless(args) -> list[str]:
    res: dict = {"stage_config": args.stage_config, "versions": _versions()}
    checks: dict[str, bool] = {}  # expectation -> met
    deadline = time.monotonic() + args.budget_s

    def note(key: str, value):  # printed as it comes: a run cut short still shows its figures
        res[key] = value
        print(f"{key}: {json.dumps(value)}", flush=True)
        return value

    def left(cap: float) -> float:
        return max(1.0, min(cap, deadline - time.monotonic()))

    master = free_port()
    common = [str(args.model), "--stage-config", args.stage_config]
    if args.stage_overrides:  # the same on both sides: head and node load the same pipeline
        common += ["--stage-overrides", args.stage_overrides]
    node_argv = [*common, "--headless", "--stage-ids", "1", "--omni-master-address", "127.0.0.1"]
    node_argv += ["--omni-master-port", str(master)]
    head = Server([*common, "--stage-ids", "0", "--omni-master-port", str(master)],
                  args.out / "headless_head.log")  # fmt: skip
    node = Node(node_argv, args.out / "headless_node-1.log")
    try:
        with PeakMemory(0) as gpu0, PeakMemory(1) as gpu1:  # each stage on its own GPU?
            note("ready_s", _wait_health(head, node, left(args.start_timeout)))
            note("first", _request(head, args, 0))
            note("warm", [_request(head, args, 10 + i) for i in range(args.repeats)])
            checks["first request 200"] = res["first"]["status"] == 200
            checks["warm requests 200"] = all(r["status"] == 200 for r in res["warm"])
        res["peak_gib"] = {"gpu0": gpu0.peak_gib, "gpu1": gpu1.peak_gib}

        counters = ("omni_stage_deaths_total", "omni_stage_restarts_total")
        before = {n: _stage1(head, n) for n in counters}
        long_args = argparse.Namespace(**vars(args))
        long_args.size, long_args.steps = args.kill_size or args.size, args.kill_steps or args.steps
        box: dict = {}
        worker = threading.Thread(
            target=lambda: box.update(r=_request(head, long_args, 1), done=time.monotonic())
        )
        sent = time.monotonic()
        worker.start()
        while _stage1(head, "omni_stage_requests_in_flight") != 1:  # the request is in the DiT
            if not worker.is_alive() or time.monotonic() - sent > left(300):
                raise RuntimeError(f"the long request never reached the node's DiT: {box}")
            time.sleep(0.1)
        tree = _tree(node.proc.pid, node.seen)
        killed = time.monotonic()
        _kill(tree)  # the whole node at once: a machine dying
        node.proc.wait(30)
        worker.join(120)
        if worker.is_alive():
            raise RuntimeError("the killed request got no answer within 120 s")
        r, err = box["r"], box["r"]["error"]
        kill = {
            "size": long_args.size,
            "steps": long_args.steps,
            "in_dit_after_s": round(killed - sent, 2),
            "answer_after_kill_s": round(box["done"] - killed, 2),
            "status": r["status"],
            "error": err,
            "health_after": httpx.get(f"{head.url}/health", timeout=5).status_code,
            "head_alive": head.proc.poll() is None,
            "node_procs_left": len(psutil.wait_procs(tree, timeout=5)[1]),
        }
        note("kill", kill)
        checks["killed request: 503, OpenAI-shaped error"] = r["status"] == 503 and (
            isinstance(err, dict) and err.get("type") == "service_unavailable_error"
        )
        checks["answer within 3 s of the kill"] = kill["answer_after_kill_s"] < 3.0
        checks["/health 503 after the kill, head alive, nothing of the node left"] = (
            kill["health_after"] == 503 and kill["head_alive"] and not kill["node_procs_left"]
        )

        node = Node(node_argv, args.out / "headless_node-2.log")
        note("restart_ready_s", _wait_health(head, node, left(args.start_timeout)))
        note("after_restart", _request(head, args, 2))
        checks["request after the restart 200"] = res["after_restart"]["status"] == 200
        for name, was in before.items():
            now = _stage1(head, name)
            delta = now - was if None not in (now, was) else None
            res[f"stage1_{name.removeprefix('omni_stage_')}_delta"] = delta
            checks[f"{name} +1"] = delta == 1
    except Exception as e:  # recorded with whatever was measured before it
        res["error"] = f"{type(e).__name__}: {e}"[-3000:]
        checks["no exception"] = False
    finally:
        head_seen: set = set()
        _tree(head.proc.pid, head_seen)
        node.stop()
        head.stop()
        _kill(head_seen)
        _keep_log_lines(head.log, args.out / "headless_log_lines.txt")
        res["failed"] = [what for what, ok in checks.items() if not ok]
        _record(args, "headless", res)
    return res["failed"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["headless"])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/bench-2gpu")))
    parser.add_argument("--stage-config", default="glm_image")
    parser.add_argument("--stage-overrides", default=None)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=0, help="requests after the first")
    parser.add_argument("--kill-size", type=int, default=None, help="the killed request's size")
    parser.add_argument("--kill-steps", type=int, default=None, help="... and steps")
    parser.add_argument("--start-timeout", type=float, default=400)
    # Start-ups and the wait for the DiT end by then: the device's 600 s a command, less stopping.
    parser.add_argument("--budget-s", type=float, default=480)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sys.exit(1 if phase_headless(args) else 0)


if __name__ == "__main__":
    main()
