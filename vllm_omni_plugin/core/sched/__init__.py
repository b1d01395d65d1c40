"""AR-stage schedulers for vLLM, named in configs by dotted path:

scheduler_cls="vllm_omni_plugin.core.sched.OmniARAsyncScheduler"   # async scheduling on/off
scheduler_cls="vllm_omni_plugin.core.sched.OmniARScheduler"        # async scheduling off only

The pairing rule itself lives in vllm_omni_plugin/config/scheduler.py.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # Lazy: importing vLLM's scheduler pulls in the engine; config code only needs the names.
    if name in ("OmniARScheduler", "OmniARAsyncScheduler"):
        from vllm_omni_plugin.core.sched import scheduler

        return getattr(scheduler, name)
    if name == "OmniARSchedulerMixin":
        from vllm_omni_plugin.core.sched.mixin import OmniARSchedulerMixin

        return OmniARSchedulerMixin
    raise AttributeError(name)
