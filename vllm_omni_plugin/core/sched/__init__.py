"""AR-stage schedulers for vLLM, named in configs by dotted path:

scheduler_cls="vllm_omni_plugin.core.sched.OmniARAsyncScheduler"   # async scheduling on/off
scheduler_cls="vllm_omni_plugin.core.sched.OmniARScheduler"        # async scheduling off only
"""

from __future__ import annotations

from typing import Any

SCHEDULERS = {
    "OmniARScheduler": "vllm_omni_plugin.core.sched.OmniARScheduler",
    "OmniARAsyncScheduler": "vllm_omni_plugin.core.sched.OmniARAsyncScheduler",
}
STAGE_OUTPUT_KEY = "omni_stage_output"


def check_scheduler_pairing(scheduler_cls: str | None, async_scheduling: bool | None) -> None:
    """Config-time twin of the schedulers' own start-up check (no vLLM import), for loaders
    that want the error when the YAML is read: a sync Omni scheduler under async scheduling."""
    name = scheduler_cls.rsplit(".", 1)[-1] if scheduler_cls else None
    if name == "OmniARScheduler" and async_scheduling:
        raise ValueError(
            "OmniARScheduler is a synchronous scheduler but async_scheduling is on; this pairing "
            f"fails on the first request. Use scheduler_cls='{SCHEDULERS['OmniARAsyncScheduler']}' "
            "(or turn async scheduling off)."
        )


def __getattr__(name: str) -> Any:
    # Lazy: importing vLLM's scheduler pulls in the engine; config code only needs the names.
    if name in ("OmniARScheduler", "OmniARAsyncScheduler"):
        from vllm_omni_plugin.core.sched import scheduler

        return getattr(scheduler, name)
    if name == "OmniARSchedulerMixin":
        from vllm_omni_plugin.core.sched.mixin import OmniARSchedulerMixin

        return OmniARSchedulerMixin
    raise AttributeError(name)
