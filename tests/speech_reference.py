"""The local Qwen3-Omni pipeline's answers (stage_configs/qwen3_omni_tiny.yaml, every stage on
one host, the tiny checkpoint): the reference that the multi-host speech tests
(tests/multinode/test_qwen3_omni_nodes.py, tests/ray/test_ray_speech.py) compare their layouts
with.

Both ask the same questions of a talker run as TALKER says, so one server start answers for
both: `local_answers` serves the checkpoint once, asks tests/multinode/ns_client.py's
`speech`, `speech-image` and `chat` (THINKER_TOKENS each) and keeps the answers in a JSON file
of `folder`, keyed by the checkpoint's bytes and these settings. A file lock makes processes
that share `folder` (the suite's xdist workers) wait for the first one's answers.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from free_ports import free_port

REPO = Path(__file__).resolve().parents[1]
VLLM = str(Path(sys.executable).parent / "vllm")
NS_CLIENT = REPO / "tests" / "multinode" / "ns_client.py"
LOCAL = "stage_configs/qwen3_omni_tiny.yaml"
THINKER_TOKENS = "8"
# Codec frames per answer, exactly: Code2Wav decodes 4, then up to 25 at a time, so 9 audio
# chunks, more than its window (8): a caller's Credits must come back before the last one.
FRAMES = 192
CODE2WAV_WINDOW = 8
# The talker greedy without the checkpoint's repetition penalty (as the served speech tests
# run it: tests/serving/conftest.py's OMNI_GREEDY_TALKER), writing exactly FRAMES frames:
# every layout of the pipeline gives the same audio.
TALKER = {
    "default_sampling_params": {
        "temperature": 0,
        "repetition_penalty": 1.0,
        "max_tokens": FRAMES,
        "min_tokens": FRAMES,
    }
}
QUESTIONS = {"speech": "speech", "speech_image": "speech-image", "chat": "chat"}


def _key(model: Path) -> str:
    digest = hashlib.sha256(json.dumps([TALKER, THINKER_TOKENS, LOCAL]).encode())
    for f in sorted(p for p in model.rglob("*") if p.is_file()):
        digest.update(str(f.relative_to(model)).encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


def local_answers(model: Path, folder: Path, log: Path) -> dict[str, dict]:
    """{"speech", "speech_image", "chat"}: ns_client.py's answers from the local pipeline,
    served (its log in `log`) only if `folder` holds none for this checkpoint yet."""
    cache = folder / f"qwen3-omni-local-answers-{_key(model)}.json"
    with open(folder / "qwen3-omni-local-answers.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if cache.exists():
            return json.loads(cache.read_text())
        answers = _serve_and_ask(model, log)
        partial = cache.with_suffix(".partial")
        partial.write_text(json.dumps(answers))
        partial.rename(cache)
        return answers


def _serve_and_ask(model: Path, log: Path) -> dict[str, dict]:
    url = f"http://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1")
    env["TOKENIZERS_PARALLELISM"] = "false"
    cmd = [VLLM, "serve", str(model), "--stage-config", LOCAL, "--host", "127.0.0.1"]
    cmd += ["--port", url.rsplit(":", 1)[1], "--stage-overrides", json.dumps({"1": TALKER})]
    server = subprocess.Popen(
        cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, cwd=REPO
    )
    tree: list[psutil.Process] = []
    try:
        t0 = time.monotonic()
        while True:
            assert server.poll() is None, log.read_text(errors="replace")[-5000:]
            # Stage processes run in sessions of their own: remember them, none outlives this.
            with contextlib.suppress(psutil.NoSuchProcess):
                kids = psutil.Process(server.pid).children(recursive=True)
                tree += [p for p in kids if p not in tree]
            assert time.monotonic() - t0 < 600, log.read_text(errors="replace")[-5000:]
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        answers = {}
        for name, question in QUESTIONS.items():
            out = subprocess.run(
                [sys.executable, str(NS_CLIENT), question, url, str(model), THINKER_TOKENS],
                capture_output=True,
                text=True,
                timeout=300,
                cwd=REPO,
            )
            assert out.returncode == 0, out.stderr[-3000:]
            answers[name] = json.loads(out.stdout.strip().splitlines()[-1])
        return answers
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(30)
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
