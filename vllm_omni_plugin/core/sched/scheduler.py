"""The AR stage's matched scheduler pair (see mixin.py for what they add)."""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_omni_plugin.core.sched.mixin import OmniARSchedulerMixin


class OmniARScheduler(OmniARSchedulerMixin, Scheduler):
    """Synchronous; refuses to start when async scheduling is on."""

    omni_async = False


class OmniARAsyncScheduler(OmniARSchedulerMixin, AsyncScheduler):
    """For async scheduling; also safe (sync mode) when the platform turns async off."""

    omni_async = True
