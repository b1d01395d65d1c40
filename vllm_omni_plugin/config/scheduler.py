"""AR scheduler pairing: the scheduler class and `async_scheduling` must agree.

A synchronous scheduler under async scheduling is what crashed a GLM-Image deployment on its
first request; here that combination cannot get past loading.
"""

from __future__ import annotations

SYNC_SCHEDULER = "vllm_omni_plugin.core.sched.OmniARScheduler"
ASYNC_SCHEDULER = "vllm_omni_plugin.core.sched.OmniARAsyncScheduler"

# Names users write (ours, short, module-qualified, vLLM-Omni's, stock vLLM's) -> ours.
SCHEDULER_ALIASES = {
    SYNC_SCHEDULER: SYNC_SCHEDULER,
    ASYNC_SCHEDULER: ASYNC_SCHEDULER,
    "OmniARScheduler": SYNC_SCHEDULER,
    "OmniARAsyncScheduler": ASYNC_SCHEDULER,
    "vllm_omni_plugin.core.sched.omni_ar_scheduler.OmniARScheduler": SYNC_SCHEDULER,
    "vllm_omni_plugin.core.sched.omni_ar_scheduler.OmniARAsyncScheduler": ASYNC_SCHEDULER,
    "vllm_omni.core.sched.omni_ar_scheduler.OmniARScheduler": SYNC_SCHEDULER,
    "vllm_omni.core.sched.omni_ar_scheduler.OmniARAsyncScheduler": ASYNC_SCHEDULER,
    "vllm_omni.core.sched.OmniARScheduler": SYNC_SCHEDULER,
    "vllm_omni.core.sched.OmniARAsyncScheduler": ASYNC_SCHEDULER,
    # Stock vLLM's pair: our stages need the Omni subclasses, which add output hand-off.
    "vllm.v1.core.sched.scheduler.Scheduler": SYNC_SCHEDULER,
    "vllm.v1.core.sched.async_scheduler.AsyncScheduler": ASYNC_SCHEDULER,
}


class SchedulerPairError(ValueError):
    """`scheduler_cls` and `async_scheduling` disagree, or the class is unknown."""


def resolve_scheduler(
    scheduler_cls: str | None, async_scheduling: bool | None
) -> tuple[str, bool, str]:
    """(scheduler class, async_scheduling, which of them was derived: "" / "cls" / "async").

    Unset both: the async pair. One set: the other follows it. Both set: they must match.
    """
    if scheduler_cls is None:
        use_async = True if async_scheduling is None else async_scheduling
        return (ASYNC_SCHEDULER if use_async else SYNC_SCHEDULER), use_async, "cls"
    ours = SCHEDULER_ALIASES.get(scheduler_cls)
    if ours is None:
        raise SchedulerPairError(
            f"unknown AR scheduler {scheduler_cls!r}; use {SYNC_SCHEDULER} (sync) or "
            f"{ASYNC_SCHEDULER} (async), or leave it unset"
        )
    is_async = ours == ASYNC_SCHEDULER
    if async_scheduling is None:
        return ours, is_async, "async"
    problem = pairing_error(scheduler_cls, async_scheduling)
    if problem is not None:
        raise SchedulerPairError(problem)
    return ours, is_async, ""


def is_async_scheduler(scheduler_cls: str) -> bool:
    """Whether a scheduler name (any alias, or a bare class name) is the asynchronous one."""
    ours = SCHEDULER_ALIASES.get(scheduler_cls)
    if ours is None:  # a bare or module-qualified name of one of ours
        ours = SCHEDULER_ALIASES.get(scheduler_cls.rsplit(".", 1)[-1], SYNC_SCHEDULER)
    return ours == ASYNC_SCHEDULER


def pairing_error(scheduler_cls: str, async_scheduling: bool) -> str | None:
    """The pairing rule, the one place it is written: the scheduler class and
    `async_scheduling` must name the same mode. None when they agree, else the message.

    Config loading applies it to what the user wrote. At run time vLLM may turn async
    scheduling off (its CPU platform does) and the asynchronous class then runs in sync mode, so
    the schedulers' start-up check needs only the direction that crashes: with async scheduling
    on, `pairing_error(cls, True)` is not None exactly for a synchronous class.
    """
    is_async = is_async_scheduler(scheduler_cls)
    if async_scheduling == is_async:
        return None
    matched = ASYNC_SCHEDULER if async_scheduling else SYNC_SCHEDULER
    kind = "asynchronous" if is_async else "synchronous"
    return (
        f"{scheduler_cls} is the {kind} scheduler but async_scheduling is "
        f"{str(async_scheduling).lower()}; use {matched} with async_scheduling: "
        f"{str(async_scheduling).lower()}, or remove scheduler_cls"
    )
