"""Stages that share a GPU start one after another (a vLLM engine profiles the device's free
memory while it starts) unless each holds itself to a stated share that fits beside the other's
without measuring (a vLLM engine with `kv_cache_memory_bytes`); stages on other devices, or on
none (CPU), start together.

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


def orchestrator(
    devices: dict[int, str | None],
    fail: set[int] = frozenset(),
    memory: dict[int, dict] | None = None,
    config: str = "glm_image_tiny",
):
    overrides = {
        str(sid): {"devices": d, **(memory or {}).get(sid, {})} for sid, d in devices.items()
    }
    cfg = load_deploy_config(config, model="/unused/glm", stage_overrides=overrides)
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


FIXED_KV = {"kv_cache_memory_bytes": 2**30}


@pytest.mark.parametrize(
    "memory",
    [
        {0: {"gpu_memory_utilization": 0.35}, 1: {"gpu_memory_utilization": 0.5}},  # AR profiles
        {0: {**FIXED_KV, "gpu_memory_utilization": 0.6}, 1: {"gpu_memory_utilization": 0.5}},
        {0: {**FIXED_KV, "gpu_memory_utilization": 0.35}, 1: {}},  # the DiT has no cap
    ],
    ids=["ar-profiles", "shares-over-1", "dit-uncapped"],
)
async def test_stages_on_one_gpu_start_apart_unless_both_shares_fit(memory):
    orch, log = orchestrator({0: "0", 1: "0"}, memory=memory)
    await orch.start()
    assert log[0][1] <= log[1][0]


async def test_stated_shares_that_fit_start_together_as_the_one_gpu_config_does():
    memory = {0: {**FIXED_KV, "gpu_memory_utilization": 0.35}, 1: {"gpu_memory_utilization": 0.5}}
    orch, log = orchestrator({0: "0", 1: "0"}, memory=memory)
    await orch.start()
    assert log[1][0] < log[0][1]  # overlapping start windows
    orch, log = orchestrator({0: "0", 1: "0"}, config="glm_image_1gpu")
    await orch.start()
    assert log[1][0] < log[0][1]
