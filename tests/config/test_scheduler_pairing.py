"""The sync/async scheduler pairing rule is written once (config/scheduler.py)."""

from __future__ import annotations

import pytest

from vllm_omni_plugin.config.scheduler import (
    ASYNC_SCHEDULER,
    SYNC_SCHEDULER,
    SchedulerPairError,
    is_async_scheduler,
    pairing_error,
    resolve_scheduler,
)


@pytest.mark.parametrize(
    "name",
    [ASYNC_SCHEDULER, "OmniARAsyncScheduler", "vllm.v1.core.sched.async_scheduler.AsyncScheduler"],
)
def test_async_names(name):
    assert is_async_scheduler(name)
    assert pairing_error(name, True) is None
    assert "asynchronous scheduler but async_scheduling is false" in pairing_error(name, False)


@pytest.mark.parametrize(
    "name", [SYNC_SCHEDULER, "OmniARScheduler", "vllm.v1.core.sched.scheduler.Scheduler"]
)
def test_sync_names(name):
    assert not is_async_scheduler(name)
    assert pairing_error(name, False) is None
    assert "synchronous scheduler but async_scheduling is true" in pairing_error(name, True)


def test_loading_applies_the_same_rule():
    with pytest.raises(SchedulerPairError) as info:
        resolve_scheduler("OmniARScheduler", True)
    assert str(info.value) == pairing_error("OmniARScheduler", True)
    assert resolve_scheduler(None, False) == (SYNC_SCHEDULER, False, "cls")
    assert resolve_scheduler("OmniARAsyncScheduler", None) == (ASYNC_SCHEDULER, True, "async")
