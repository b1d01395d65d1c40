"""SIGTERM, SIGINT and SIGKILL to `vllm serve` of a stage pipeline: nothing outlives it.

* SIGTERM with a streamed speech request open (tiny Qwen3-Omni: thinker -> talker -> Code2Wav,
  the official `openai` client, pcm16): the stream ends with an error event instead of hanging,
  and within STOP_BOUND_S every process of the server's tree is gone: the API server, each
  stage process (in its own session), the thinker's vLLM engine core and worker, anything
  else in a stage's session. The log has no traceback, no "Task was destroyed but it is
  pending!", no "AsyncLLM output_handler failed" (each stage winds its asyncio tasks down in
  order, stages/loop.py).
* SIGINT with an image request in flight (tiny GLM-Image: AR -> DiT): the request is answered
  503; the same checks.
* SIGKILL to the API server while its stages load: the stages and their engines' processes
  exit within STOP_BOUND_S (they watch the server, common/parent_watch.py), where before a
  loading stage went on until its start-up ended.

tests/multinode/test_node_parent_death.py covers a headless node whose launcher is killed.
"""

from __future__ import annotations

import base64
import os
import signal
import threading
import time

import httpx
import openai
import psutil
import pytest
from conftest import start_shared
from omni_server import API_KEY, REPO, Server, alive

pytestmark = pytest.mark.slow

# The whole server gone after SIGINT/SIGTERM or, after a SIGKILL, its stages: an AR stage's
# vLLM engine takes up to ~5.5 s to stop (orchestrator/stage_process.STOP_WAIT_S).
STOP_BOUND_S = 10.0
FORBIDDEN = (
    "Traceback",
    "Task was destroyed but it is pending",
    "output_handler failed",
    "GeneratorExit",
)
# The talker's frame cap raised from 64 to 768 (within its max_model_len), so that the speech
# request still streams when the signal comes (the test checks it had not ended). The thinker's
# vLLM worker in a process of its own (vLLM's CPU default; the suite runs workers in their
# engine core), so the signal must end that process too; the talker's stays in its engine core,
# one torch + vLLM start-up fewer.
SPEECH_OVERRIDES = (
    '{"0": {"env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}}, '
    '"1": {"default_sampling_params": {"max_tokens": 768, "min_tokens": 768}}}'
)


class ProcessTree:
    """Every process of a server: its descendants, and anything in a stage's own session
    (a stage starts its own session; what it starts stays in it)."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.procs: dict[int, psutil.Process] = {pid: self.root}
        self.sessions: set[int] = set()

    def collect(self) -> list[psutil.Process]:
        try:
            found = self.root.children(recursive=True)
        except psutil.NoSuchProcess:
            found = []
        own = os.getsid(self.root.pid)
        for p in found:
            self.procs.setdefault(p.pid, p)
            try:
                sid = os.getsid(p.pid)
            except OSError:
                continue
            if sid != own:
                self.sessions.add(sid)
        return found

    def names(self) -> list[str]:
        out = []
        for p in self.collect():
            try:
                out.append(p.name())
            except psutil.NoSuchProcess:
                pass
        return out

    def alive(self) -> list[str]:
        left = {pid for pid, p in self.procs.items() if alive(p)}
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) in self.sessions and alive(p):
                    left.add(p.pid)
            except (OSError, psutil.Error):
                continue
        return [f"{pid} {_describe(pid)}" for pid in sorted(left)]

    def wait_gone(self, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if not self.alive():
                return time.monotonic() - t0
            time.sleep(0.1)
        left = self.alive()
        if not left:
            return time.monotonic() - t0
        raise AssertionError(f"alive {timeout} s after the signal: {left}")

    def kill(self) -> None:
        """Whatever a failed test left behind."""
        for entry in self.alive():
            try:
                os.kill(int(entry.split()[0]), signal.SIGKILL)
            except OSError:
                pass


def _describe(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:120]
    except psutil.Error:
        return "?"


def _wait_for(cond, what: str, timeout: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout} s")


def _clean_log(server: Server) -> None:
    text = server.log.read_text(errors="replace")
    for bad in FORBIDDEN:
        assert bad not in text, f"{bad!r} in the server log:\n{server.log_tail(80)}"


def _stop_and_check(server: Server, tree: ProcessTree, sig: int) -> float:
    tree.collect()
    assert tree.sessions, "no stage process found"
    t0 = time.monotonic()
    server.proc.send_signal(sig)
    tree.wait_gone(STOP_BOUND_S)
    took = time.monotonic() - t0
    server.proc.wait(5)
    return took


def test_sigterm_ends_an_open_speech_stream_and_every_process(tiny_models, tmp_path):
    """Over 60 s: the signal ends the server, so the test starts its own
    Qwen3-Omni server (the thinker's vLLM engine, the talker, Code2Wav) and no other test can
    share it."""
    server = start_shared(
        tiny_models("qwen3-omni"),
        REPO / "stage_configs" / "qwen3_omni_tiny.yaml",
        tmp_path,
        "--stage-overrides",
        SPEECH_OVERRIDES,
    )
    tree = ProcessTree(server.proc.pid)
    outcome: dict = {"audio": 0}
    first_audio = threading.Event()

    def listen() -> None:
        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60
        )
        outcome["sent"] = time.monotonic()
        try:
            stream = client.chat.completions.create(
                model=server.model,
                messages=[{"role": "user", "content": "Say hi"}],
                stream=True,
                modalities=["text", "audio"],
                audio={"voice": "ethan", "format": "pcm16"},
                max_tokens=32,
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                audio = chunk.choices[0].delta.audio if chunk.choices else None
                audio = audio if audio is None or isinstance(audio, dict) else audio.model_dump()
                if audio and audio.get("data"):
                    outcome["audio"] += len(base64.b64decode(audio["data"]))
                    outcome.setdefault("first_audio", time.monotonic())
                    first_audio.set()
            outcome["end"] = "complete"
        except Exception as exc:  # the error event, as the client raises it
            outcome["end"] = exc
        finally:
            outcome["at"] = time.monotonic()
            first_audio.set()

    reader = threading.Thread(target=listen)
    try:
        reader.start()
        assert first_audio.wait(120), "no audio streamed"
        assert "end" not in outcome, f"the stream ended before the signal: {outcome}"
        assert {"VLLM::EngineCore", "VLLM::Worker"} <= set(tree.names())
        took = _stop_and_check(server, tree, signal.SIGTERM)
        reader.join(STOP_BOUND_S)
        assert not reader.is_alive(), "the stream still hangs"
        assert isinstance(outcome["end"], openai.APIError), outcome["end"]
        assert "shutting down" in str(outcome["end"])
        _clean_log(server)
        first = outcome["first_audio"] - outcome["sent"]
        print(
            f"SIGTERM: started in {server.startup_s:.1f} s, first audio {first:.1f} s after the "
            f"request; stream ended with "
            f"{outcome['end']!r}; server gone in {took:.1f} s"
        )
    finally:
        server.stop()
        tree.kill()


def test_sigint_answers_the_request_in_flight_503_and_ends_every_process(tiny_models, tmp_path):
    """Over 60 s: the signal ends the server, so the test starts its own
    GLM-Image server (the AR stage's vLLM engine, the DiT stage) and no other test can share
    it."""
    server = start_shared(
        tiny_models("glm-image"), REPO / "stage_configs" / "glm_image_tiny.yaml", tmp_path
    )
    tree = ProcessTree(server.proc.pid)
    outcome: dict = {}

    def request() -> None:
        # 256x256 at 200 steps keeps the DiT busy for tens of seconds on this CPU.
        body = {"prompt": "a lighthouse", "size": "256x256", "num_inference_steps": 200}
        outcome["resp"] = httpx.post(
            f"{server.url}/v1/images/generations",
            json=body,
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=120,
        )

    def in_dit() -> bool:
        for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
            if line.startswith("omni_stage_requests_in_flight{") and 'stage_id="1"' in line:
                return float(line.rsplit(" ", 1)[1]) == 1
        return False

    worker = threading.Thread(target=request)
    try:
        worker.start()
        _wait_for(in_dit, "the request never reached the DiT", 120)
        took = _stop_and_check(server, tree, signal.SIGINT)
        worker.join(STOP_BOUND_S)
        resp = outcome["resp"]
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["type"] == "service_unavailable_error"
        _clean_log(server)
        print(f"SIGINT: request answered {resp.status_code}; server gone in {took:.1f} s")
    finally:
        server.stop()
        tree.kill()


def test_sigkill_of_the_api_server_ends_its_loading_stages(tiny_models, tmp_path):
    """The API server SIGKILLed while its AR stage builds its vLLM engine (its engine core is
    up, the model loading) and the DiT stage loads: nobody reads the stages' control sockets
    yet, so only their watch on the server ends them, engine processes included."""
    server = Server(
        [
            str(tiny_models("glm-image")),
            "--stage-config",
            str(REPO / "stage_configs" / "glm_image_tiny.yaml"),
        ],
        tmp_path / "server.log",
    )
    tree = ProcessTree(server.proc.pid)
    try:
        _wait_for(lambda: "VLLM::EngineCore" in tree.names(), "no vLLM engine core started", 300)
        tree.collect()
        assert len(tree.sessions) == 2, tree.sessions  # both stages
        assert server.proc.poll() is None
        t0 = time.monotonic()
        server.proc.kill()
        server.proc.wait(5)
        took = tree.wait_gone(STOP_BOUND_S)
        print(f"SIGKILL during start-up: stages gone {time.monotonic() - t0:.1f} s after ({took})")
    finally:
        server.stop()
        tree.kill()
