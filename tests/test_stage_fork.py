"""Stages forked from the fork server (orchestrator/stage_fork.py, stages/fork_server.py).

Real parts: the fork server process with its imports, forked `stages.worker` processes, and
their control sockets. A worker whose first message is not StartStage exits with status 1 and
says why on its log pipe, which lets these tests see a forked stage's whole life without
loading a model; the served tests start real stages through the same path.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import get_args

import psutil
import pytest

from vllm_omni_plugin.common.channel import server_channel
from vllm_omni_plugin.common.messages import Shutdown
from vllm_omni_plugin.orchestrator import stage_fork
from vllm_omni_plugin.orchestrator.stage_process import stage_env
from vllm_omni_plugin.pipelines.topology import StageKind

BASE = {"PATH": "/usr/bin", "HF_HUB_OFFLINE": "1", "VLLM_OMNI_X": "a"}
# What a diffusion pipeline's fork server imports: the worker these tests fork needs no more.
PRELOAD = stage_fork.modules_to_preload(["diffusion"])


@pytest.mark.parametrize(
    ("change", "forked"),
    [
        ({"CUDA_VISIBLE_DEVICES": "1"}, True),  # read when CUDA starts, in the stage
        ({"VLLM_OMNI_X": "b", "OMNI_Y": "1"}, True),  # the plugin's own, read when used
        ({"PYTEST_CURRENT_TEST": "t"}, True),  # nothing the server imported reads it
        ({"PYTHONPATH": "/elsewhere"}, False),  # read by the interpreter at its start
        ({"OMP_NUM_THREADS": "4"}, False),  # read by OpenMP when torch loads it
        ({"HF_HOME": "/elsewhere"}, False),  # read by huggingface_hub at its import
        ({"VLLM_LOGGING_LEVEL": "DEBUG"}, False),  # vLLM configures its logger at import
        ({"HF_HUB_OFFLINE": None}, False),  # one the stage lacks
    ],
)
def test_a_stage_is_forked_unless_it_needs_its_own_value_of_a_variable_read_at_load(change, forked):
    env = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    differences = stage_fork.read_at_load_differences(env, BASE)
    assert differences == ([] if forked else list(change))


@pytest.fixture
def fork():
    """Forks a stage in the usual environment; a stage a failed test left running is ended,
    and its exit awaited, so that the next test finds its server idle."""
    children = []

    def _fork(title: str):
        ours, theirs = socket.socketpair()
        try:
            child = stage_fork.fork_stage(
                [title], stage_env(None), stage_env(None), PRELOAD, title, theirs.fileno()
            )
        finally:
            theirs.close()
        if child is not None:
            children.append(child)
        return child, server_channel(Connection(ours.detach()))

    yield _fork
    for child in children:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(30)


def test_a_start_short_of_descriptors_does_not_keep_later_stages_from_forking(fork):
    """First of the forks here: with no descriptor left, starting the fork server (or, where
    one runs, forking) fails and the stage is left to a fresh interpreter, which fails alike;
    the next stage, with descriptors again, is forked."""
    ours, theirs = socket.socketpair()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = {int(fd) for fd in os.listdir("/proc/self/fd")}
    lowest_free = next(fd for fd in range(1 << 20) if fd not in used)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        env = stage_env(None)
        assert (
            stage_fork.fork_stage(
                ["omni-stage-6"], env, env, PRELOAD, "omni-stage-6", theirs.fileno()
            )
            is None
        )
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        ours.close()
        theirs.close()
    child, control = fork("omni-stage-6")
    assert isinstance(child, stage_fork.ForkedProcess)
    control.send(Shutdown())
    assert child.wait(60) == 1


def test_a_forked_stage_runs_in_its_own_session_and_folder_and_reports_its_exit(
    tmp_path, monkeypatch, fork
):
    monkeypatch.chdir(tmp_path)
    child, control = fork("omni-stage-7")
    assert isinstance(child, stage_fork.ForkedProcess)
    proc = psutil.Process(child.pid)
    assert proc.parent().name() == "omni-fork-server"
    assert os.getsid(child.pid) == child.pid  # killing its group ends what it starts
    assert proc.cwd() == str(tmp_path)  # as it is when the orchestrator hears of it
    control.send(Shutdown())  # not StartStage: the worker refuses it and exits
    assert child.wait(60) == 1
    log = child.stdout.read().decode()
    assert "expected StartStage first, got Shutdown" in log


def test_a_forked_stage_killed_by_a_signal_reports_it(fork):
    child, _control = fork("omni-stage-8")
    assert child is not None
    with pytest.raises(Exception, match="stage process"):
        child.wait(0.1)  # waiting for its first message
    assert child.poll() is None
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL
    assert child.poll() == -signal.SIGKILL


def test_a_stage_that_cannot_be_forked_is_left_to_a_fresh_interpreter(monkeypatch):
    env = {**stage_env(None), "PYTHONPATH": "/elsewhere"}
    assert (
        stage_fork.fork_stage(["omni-stage-9"], env, stage_env(None), PRELOAD, "omni-stage-9", -1)
        is None
    )
    monkeypatch.setenv(stage_fork.FORK_ENV, "0")
    assert stage_fork.fork_stage(["x"], stage_env(None), stage_env(None), PRELOAD, "x", -1) is None


def test_another_environment_gets_its_own_fork_server_and_an_idle_one_is_closed(
    monkeypatch, tmp_path, fork
):
    """Last here: it leaves the process with a server for another HF_HOME, which the next
    fork for the usual environment closes (it is idle by then)."""
    first, control = fork("omni-stage-10")
    assert isinstance(first, stage_fork.ForkedProcess)
    first_server = psutil.Process(first.pid).parent()
    control.send(Shutdown())
    assert first.wait(60) == 1  # its server has no stage left
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # read by huggingface_hub as it loads
    second, control = fork("omni-stage-11")
    assert isinstance(second, stage_fork.ForkedProcess)
    second_server = psutil.Process(second.pid).parent()
    assert second_server.name() == "omni-fork-server" and second_server.pid != first_server.pid
    first_server.wait(30)  # closed: it exits at EOF (its exit code goes to its Popen)
    assert not first_server.is_running()
    control.send(Shutdown())
    assert second.wait(60) == 1


def test_a_pipeline_preloads_the_engines_of_its_stages_only():
    """A diffusion pipeline's fork server skips vLLM's engine (~5 of its ~8 CPU-s of imports);
    a pipeline with an AR stage loads it; each kind's loop module comes with its kind."""
    from vllm_omni_plugin.stages import fork_server

    diffusion = stage_fork.modules_to_preload(["diffusion"])
    glm = stage_fork.modules_to_preload(["diffusion", "ar"])
    assert "vllm.v1.engine.async_llm" not in diffusion and "diffusers" in diffusion
    assert glm == stage_fork.modules_to_preload(
        ["ar", "diffusion", "diffusion"]
    )  # one server per pipeline
    assert set(glm) == set(diffusion) | set(stage_fork.modules_to_preload(["ar"]))
    assert "vllm_omni_plugin.stages.qwen3_omni" in stage_fork.modules_to_preload(["code2wav"])
    assert "vllm.v1.engine.async_llm" in stage_fork.modules_to_preload(["talker"])
    for kind in get_args(StageKind):  # every kind says what it loads
        assert stage_fork.modules_to_preload([kind])[0] == "transformers"
    # What the diffusion server imports does not pull vLLM in by another way.
    probe = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)\n"
    probe += "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    out = subprocess.run(
        [sys.executable, "-c", probe, *fork_server.PRELOAD, *diffusion],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
