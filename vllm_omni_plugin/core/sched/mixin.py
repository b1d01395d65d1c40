"""What the AR stage's schedulers add to vLLM's: a checked sync/async pairing and stage output.

vLLM takes any `--scheduler-cls` without checking it against `async_scheduling`. A synchronous
scheduler under async scheduling breaks on the first request (the GLM-Image incident: KeyError
in the model runner), so OmniARScheduler refuses that pairing at construction, which every path
goes through (YAML stage config, `--scheduler-cls`, Python `LLM(...)`). The reverse pairing is
safe: vLLM's CPU platform turns async scheduling off after the config is built, and
OmniARAsyncScheduler then simply runs in sync mode (logged once).

Stage output: when a request finishes, its full output token ids are taken from the
scheduler's own `Request` (CachedRequestData.all_token_ids is only filled for requests that were
not scheduled in the previous step, so it is not a history) and attached to the finished
EngineCoreOutput under `kv_transfer_params[STAGE_OUTPUT_KEY]`; vLLM carries that dict to the
front end's `RequestOutput.kv_transfer_params` unchanged. Override `stage_output()` to attach
more (e.g. a connector descriptor).

Aborts that arrive while a step is in flight: vLLM applies them just before
`update_from_output`, so a step's output may name requests that are already finished and freed;
the base class skips those, and `_free_request` here only reads the request it is given.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.request import Request, RequestStatus

from vllm_omni_plugin.core.sched import STAGE_OUTPUT_KEY

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
        self.num_stage_outputs = 0

    @classmethod
    def _check_async_pairing(cls, vllm_config: Any) -> None:
        async_on = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        if async_on and not cls.omni_async:
            raise ValueError(
                f"{cls.__name__} is a synchronous scheduler but async scheduling is on; this "
                "pairing fails on the first request. Use "
                "scheduler_cls='vllm_omni_plugin.core.sched.OmniARAsyncScheduler' "
                "(or turn async scheduling off)."
            )
        if cls.omni_async and not async_on:
            logger.info_once(
                "%s: async scheduling is off (the CPU platform turns it off); running in sync "
                "mode.",
                cls.__name__,
            )

    def stage_output(self, request: Request) -> dict[str, Any]:
        """What the next stage gets from a finished request (msgpack-serializable)."""
        return {
            "output_token_ids": list(request.output_token_ids),
            "num_prompt_tokens": request.num_prompt_tokens,
            "finish_reason": str(request.get_finished_reason()),
        }

    def _free_request(
        self, request: Request, delay_free_blocks: bool = False
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        # Read the history before the base class frees the request.
        payload = None
        if request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
            payload = self.stage_output(request)
        kv_params, ec_params = super()._free_request(request, delay_free_blocks)
        if payload is not None:
            kv_params = {**(kv_params or {}), STAGE_OUTPUT_KEY: payload}
            self.num_stage_outputs += 1
        return kv_params, ec_params
