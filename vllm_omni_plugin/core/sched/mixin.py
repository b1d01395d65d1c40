"""What the AR stage's schedulers add to vLLM's: a checked sync/async pairing.

vLLM takes any `--scheduler-cls` without checking it against `async_scheduling`. A synchronous
scheduler under async scheduling breaks on the first request (the GLM-Image incident: KeyError
in the model runner), so OmniARScheduler refuses that pairing at construction, which every path
goes through (YAML stage config, `--scheduler-cls`, Python `LLM(...)`). The reverse pairing is
safe: vLLM's CPU platform turns async scheduling off after the config is built, and
OmniARAsyncScheduler then simply runs in sync mode (logged once).

The only vLLM method overridden is the constructor, passed through with `*args, **kwargs`; it
reads `vllm_config` (the first parameter of `Scheduler.__init__` in vLLM 0.26 to 0.33) and its
`scheduler_config.async_scheduling`. The stage's output is the finished `RequestOutput`'s token
ids (stages/ar_stage.py), so no private scheduler method is overridden for it.
`scripts/check_vllm_seams.py` checks these names for every supported vLLM minor.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from vllm_omni_plugin.config.scheduler import ASYNC_SCHEDULER, SYNC_SCHEDULER, pairing_error

# Under "vllm." so vLLM's own log handler prints it in engine and worker processes.
logger = init_logger("vllm.omni_plugin.sched")


class OmniARSchedulerMixin:
    """Mixed into vLLM's Scheduler / AsyncScheduler (put it first in the bases)."""

    #: True for the class meant for async scheduling.
    omni_async: bool = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        self._check_async_pairing(vllm_config)
        super().__init__(*args, **kwargs)

    @classmethod
    def _check_async_pairing(cls, vllm_config: Any) -> None:
        async_on = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        # The rule lives in config/scheduler.py; at run time only the crashing direction
        # (a synchronous class with async scheduling on) is an error.
        problem = pairing_error(ASYNC_SCHEDULER if cls.omni_async else SYNC_SCHEDULER, async_on)
        if async_on and problem is not None:
            raise ValueError(
                f"{cls.__name__} is a synchronous scheduler but async scheduling is on; this "
                f"pairing fails on the first request. {problem}"
            )
        if cls.omni_async and not async_on:
            logger.info_once(
                "%s: async scheduling is off (the CPU platform turns it off); running in sync "
                "mode.",
                cls.__name__,
            )
