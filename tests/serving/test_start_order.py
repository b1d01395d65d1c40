"""Stages that share a GPU start one after another (a vLLM engine profiles the device's free
memory while it starts); stages on other devices, or on none (CPU), start together.

The stage clients here are stand-ins that only record when `start` ran: what is under test is
the orchestrator's ordering, through its `stage_factory` seam (the one remote stages use)."""

from __future__ import annotations

import asyncio
import time

import pytest

from vllm_omni_plugin.config import load_deploy_config
from vllm_omni_plugin.orchestrator.orchestrator import Orchestrator


class RecordingStage:
    def __init__(self, log: dict, sid: int, fail: bool = False):
        self.log, self.sid, self.fail, self.ready = log, sid, fail, False

    async def start(self) -> None:
        t0 = time.monotonic()
        await asyncio.sleep(0.2)
        if self.fail:
            raise RuntimeError(f"stage {self.sid} failed to start")
        self.log[self.sid] = (t0, time.monotonic())
        self.ready = True

    def shutdown(self) -> None:
        self.ready = False


def orchestrator(devices: dict[int, str | None], fail: set[int] = frozenset()):
    overrides = {str(sid): {"devices": d} for sid, d in devices.items()}
    cfg = load_deploy_config("glm_image_tiny", model="/unused/glm", stage_overrides=overrides)
    log: dict = {}
    orch = Orchestrator(
        cfg,
        stage_factory=lambda init: RecordingStage(
            log, init.spec.stage_id, init.spec.stage_id in fail
        ),
    )
    return orch, log


async def test_stages_on_one_gpu_start_in_topological_order():
    orch, log = orchestrator({0: "0", 1: "0"})
    await orch.start()
    assert log[0][1] <= log[1][0]  # the DiT started after the AR engine was ready


async def test_stages_on_different_devices_start_together():
    for devices in ({0: "0", 1: "1"}, {0: None, 1: None}):
        orch, log = orchestrator(devices)
        await orch.start()
        assert log[1][0] < log[0][1]  # overlapping start windows


async def test_a_failed_start_keeps_the_next_stage_on_its_gpu_from_starting():
    orch, log = orchestrator({0: "0", 1: "0"}, fail={0})
    with pytest.raises(RuntimeError, match="stage 0 failed"):
        await orch.start()
    assert 1 not in log
