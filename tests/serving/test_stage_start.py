"""A stage start that fails in the spawn itself (a real OSError: the API server is out of file
descriptors) is logged and retried with backoff like any other failed start, gives up after
STARTUP_ATTEMPTS on the first start, and leaves no descriptor or process behind.

A start whose engine refuses its settings is not retried (a real AR stage, below). A start whose
process exits, then succeeds on retry, is in test_glm_serve.py (real stages).
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource

import pytest

from vllm_omni_plugin.common.exit_status import EXIT_CONFIG
from vllm_omni_plugin.config import load_deploy_config
from vllm_omni_plugin.config.stage_init import StageInit
from vllm_omni_plugin.orchestrator import stage_client
from vllm_omni_plugin.orchestrator.errors import StageConfigError, StageStartupError
from vllm_omni_plugin.orchestrator.stage_client import StageClient


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def limit_leaving(free: int) -> int:
    """An RLIMIT_NOFILE under which exactly `free` more descriptors can be opened."""
    used = open_fds()
    candidates = (n for n in range(1 << 20) if n not in used)
    for _ in range(free):
        next(candidates)
    return next(candidates)


@pytest.fixture
def init() -> StageInit:
    cfg = load_deploy_config("glm_image")
    spec = cfg.topology.stages[-1]
    return StageInit(stage=cfg.stage(spec.stage_id), spec=spec, pipeline=cfg.pipeline)


def test_spawn_oserror_is_retried_then_given_up_leaving_nothing(init, caplog, monkeypatch):
    monkeypatch.setattr(stage_client, "FIRST_BACKOFF_S", 0.1)
    client = StageClient(init, startup_timeout_s=5)
    name = f"stage {client.stage_id} ({client.kind})"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    async def start() -> set[int]:
        await asyncio.sleep(0)
        before = open_fds()
        # Room for the control socket pair, none for the pipes Popen makes: Popen raises EMFILE.
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit_leaving(2), hard))
        try:
            with pytest.raises(StageStartupError, match="failed to start .OSError"):
                await client.start()
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        return before

    with caplog.at_level(logging.ERROR, logger="vllm_omni_plugin.orchestrator"):
        before = asyncio.run(start())
    assert open_fds() <= before  # the socket pair of every attempt was closed
    assert client.state == "dead" and client.start_failures == stage_client.STARTUP_ATTEMPTS
    assert client.proc is not None and client.proc.proc is None  # no process was ever made
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"start of {name} failed (attempt 1), retrying in 0.1 s" in m for m in lines), lines
    last = stage_client.STARTUP_ATTEMPTS
    assert any(f"start of {name} failed (attempt {last}), giving up" in m for m in lines), lines


def test_only_work_messages_count_as_progress_for_the_stall_watchdog(init):
    # An AR stage's control loop answers inspections and sends metrics even while its engine is
    # stuck: neither may reset the stall clock; a Pulse from the engine loop does.
    from vllm_omni_plugin.common.messages import EngineMetrics, Inspection, Pulse

    client = StageClient(init, startup_timeout_s=5)
    client.pending.last_progress = 0.0
    client._on_message(Inspection(token=1, stage_id=client.stage_id))
    client._on_message(EngineMetrics(stage_id=client.stage_id, families=[]))
    assert client.pending.last_progress == 0.0
    client._on_message(Pulse(stage_id=client.stage_id))
    assert client.pending.last_progress > 0.0


def test_settings_the_engine_refuses_end_the_first_start_at_once(tiny_models, caplog):
    """The AR stage's vLLM engine refuses a context longer than the checkpoint's positions
    (pydantic's validation in vLLM's ModelConfig): the stage exits with EX_CONFIG and the
    first start gives up after that one attempt, naming the field, where another start would
    only be refused again."""
    cfg = load_deploy_config(
        "glm_image_tiny",
        model=str(tiny_models("glm-image")),
        stage_overrides={"0": {"max_model_len": 1 << 20}},
    )
    spec = cfg.topology.stages[0]
    client = StageClient(
        StageInit(stage=cfg.stage(spec.stage_id), spec=spec, pipeline=cfg.pipeline),
        startup_timeout_s=300,
    )
    name = f"stage {client.stage_id} ({client.kind})"
    with caplog.at_level(logging.ERROR, logger="vllm_omni_plugin.orchestrator"):
        with pytest.raises(StageConfigError, match="refused its engine settings") as refused:
            asyncio.run(client.start())
    assert "max_model_len" in str(refused.value)  # the stage's log tail names the field
    assert client.state == "dead" and client.start_failures == 1
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"start of {name} failed (attempt 1), giving up" in m for m in lines), lines
    assert client.proc is not None and client.proc.returncode() == EXIT_CONFIG
