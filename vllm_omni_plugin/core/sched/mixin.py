"""What the AR stage's schedulers add to vLLM's: a checked sync/async pairing.

vLLM takes any `--scheduler-cls` without checking it against `async_scheduling`. A synchronous
scheduler under async scheduling breaks on the first request (the GLM-Image incident: KeyError
in the model runner), so that pairing is refused as soon as vLLM has built the engine's config
(`check_scheduler_pairing`, run by the general plugin's wrap of `EngineArgs.create_engine_config`:
entry_points/patches.py, patch 8), before an engine core starts or a model loads, on every path
(YAML stage config, `--scheduler-cls`, Python `LLM(...)`). The schedulers check again at
construction, for a config built some other way. The reverse pairing is safe: vLLM's CPU
platform turns async scheduling off while the config is built, and OmniARAsyncScheduler then
simply runs in sync mode (logged once).

The only vLLM method overridden is the constructor, passed through with `*args, **kwargs`; it
reads `vllm_config` (the first parameter of `Scheduler.__init__` in vLLM 0.26 to 0.33) and its
`scheduler_config.async_scheduling`. The stage's output is the finished `RequestOutput`'s token
ids (stages/ar_stage.py), so no private scheduler method is overridden for it.
`scripts/check_vllm_seams.py` checks these names for every supported vLLM minor.
"""

from __future__ import annotations

import importlib
from typing import Any

from vllm.logger import init_logger

from vllm_omni_plugin.config.scheduler import (
    ASYNC_SCHEDULER,
    SYNC_SCHEDULER,
    SchedulerPairError,
    pairing_error,
)

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
        cls._refuse_sync_under_async(vllm_config)
        if cls.omni_async and not _async_on(vllm_config):
            logger.info_once(
                "%s: async scheduling is off (the CPU platform turns it off); running in sync "
                "mode.",
                cls.__name__,
            )

    @classmethod
    def _refuse_sync_under_async(cls, vllm_config: Any) -> None:
        async_on = _async_on(vllm_config)
        # The rule lives in config/scheduler.py; at run time only the crashing direction
        # (a synchronous class with async scheduling on) is an error.
        problem = pairing_error(ASYNC_SCHEDULER if cls.omni_async else SYNC_SCHEDULER, async_on)
        if async_on and problem is not None:
            raise SchedulerPairError(
                f"{cls.__name__} is a synchronous scheduler but async scheduling is on; this "
                f"pairing fails on the first request. {problem}"
            )


def _async_on(vllm_config: Any) -> bool:
    return bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))


def _our_scheduler(scheduler_cls: Any) -> type[OmniARSchedulerMixin] | None:
    """The AR scheduler class that `scheduler_cls` (a class, or a dotted name in this package)
    is, or None for any other scheduler: those are vLLM's business, untouched here."""
    if isinstance(scheduler_cls, str):
        if not scheduler_cls.startswith("vllm_omni_plugin."):
            return None
        module, _, name = scheduler_cls.rpartition(".")
        try:
            scheduler_cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return None  # vLLM reports a name that does not resolve, as for any scheduler
    if isinstance(scheduler_cls, type) and issubclass(scheduler_cls, OmniARSchedulerMixin):
        return scheduler_cls
    return None


def check_scheduler_pairing(vllm_config: Any) -> None:
    """Refuse, as a config error, a synchronous AR scheduler with async scheduling on in a
    finished VllmConfig (after the platform's last word on async scheduling)."""
    cls = _our_scheduler(vllm_config.scheduler_config.scheduler_cls)
    if cls is not None:
        cls._refuse_sync_under_async(vllm_config)
