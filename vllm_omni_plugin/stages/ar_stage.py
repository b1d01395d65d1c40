"""An AR stage process: a vLLM AsyncLLM (stock engine, our model and scheduler) driven by the
stage loop (loop.py: socket, dispatch, pulses, inspection, replies). Requests decode together
(continuous batching); each finished request's output goes to the next stage through the
edge's connector.

The pipeline-specific part (prompt building, sampling constraint, output -> payload) comes from
`ar_glue.py`, keyed by the topology.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from ..common.errors import RequestValidationError
from ..common.messages import (
    ENGINE_METRICS_INTERVAL_S,
    ARSettings,
    EngineMetrics,
    GenerateText,
    Progress,
    Result,
    StageInfo,
    Submit,
)
from ..config.stage_init import StageInit
from ..config.vllm_engine_fields import vllm_worker_title_prefix
from ..models import thinker_states
from ..pipelines.registry import get_pipeline
from . import engine_metrics
from .ar_glue import glue_for
from .ar_text import run_text, speak_chat
from .engine_warmup import sampler_settings, text_prompt, warm_step_shapes
from .loop import AsyncStageLoop, _cancel_all, _log_task_failure
from .thinker_media import ThinkerMedia
from .token_clock import TokenClock

logger = logging.getLogger("vllm_omni_plugin.stages.ar")


def chat_stage_engine_args(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """A chat stage's engine arguments: its requests arrive processed by the API server's front
    end (serving/text_engine.py), every multimodal item in full. vLLM's engine core would keep a
    mirror of the front end's processor cache, storing each item to resolve repeats sent by key
    alone; none is ever sent so, so the engine keeps no cache (up to `mm_processor_cache_gb` of
    host memory otherwise)."""
    return {**engine_kwargs, "mm_processor_cache_gb": 0}


# vLLM on CPU: a first request with a 1-token prompt can kill the worker (SIGILL) under
# --enforce-eager; a short warm-up request with a longer prompt avoids it.
WARMUP_PROMPT = [1, 2, 3, 4]

# vLLM's multiprocess executor (the only one its CPU platform runs) keeps each worker
# busy-polling its shared-memory queue for 1 s after every read (shm_broadcast.SpinCondition,
# busy_loop_s=1, no setting for it in 0.32/0.33). After an AR request that second is exactly when
# the API server, the connector and the next stage need the CPU; on a small CPU box the spinning
# worker takes a core from them (measured on 2 cores: the 64x64 DiT 834 ms -> 119 ms at nice 19,
# stage hops 6-10 ms -> 2-6 ms). A worker at the lowest priority gives way when anything else is
# runnable and still gets every idle core, so an AR stage alone decodes at full speed (AR stage
# time unchanged). 0 keeps vLLM's priority.
WORKER_NICE_ENV = "OMNI_AR_WORKER_NICE"
START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
CPU_DEFAULT_WORKER_NICE = 19

# How often the stage checks that its vLLM engine core is alive. One that died (a device error,
# a crashed worker) would fail every request while the stage looks ready: the stage exits
# instead, and the orchestrator restarts it.
ENGINE_CHECK_S = 1.0


def serve_engine(engine_args):
    """vLLM's AsyncLLM for a stage, configured as `vllm serve` configures its engine: its usage
    context picks the defaults for this hardware that a deploy leaves unset (on an H100/H200,
    8192 tokens a step and up to 1024 sequences, where AsyncLLM's own default is 2048 tokens;
    the step budget also bounds one image, audio or video item's encoder tokens). The API
    server's view of a chat stage's engine (serving/text_engine.py) is built the same way."""
    import torch
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    usage = UsageContext.OPENAI_API_SERVER
    vllm_config = engine_args.create_engine_config(usage)
    start_method = engine_core_start_method(
        vllm_config.device_config.device_type,
        torch_threads=torch.get_num_threads(),
        distributed=torch.distributed.is_available() and torch.distributed.is_initialized(),
    )
    if start_method is not None:
        os.environ[START_METHOD_ENV] = start_method
    return AsyncLLM.from_vllm_config(
        vllm_config,
        usage_context=usage,
        enable_log_requests=engine_args.enable_log_requests,
        disable_log_stats=engine_args.disable_log_stats,
    )


def engine_core_start_method(device_type: str, torch_threads: int, distributed: bool) -> str | None:
    """How this stage's vLLM engine core process starts, where we choose otherwise than vLLM.

    vLLM forks it from the stage process on GPUs, but its CPU platform sets `spawn` (in
    VLLM_WORKER_MULTIPROC_METHOD, whatever it held) while the engine's config is built: a fresh
    interpreter that imports torch and vLLM again, ~7 CPU-seconds per engine. The reason is
    OpenMP: a process forked after torch started its OpenMP worker threads inherits a pool
    whose threads it does not have. A stage whose torch runs one thread (`torch_threads`) never
    starts that pool, so there the engine core is forked, as on a GPU; with more threads vLLM's
    choice stands. So it does in a process that already set up torch.distributed
    (`distributed`: an engine run in-process before): a forked child would inherit a process
    group without its threads and wait on it forever. None: leave it to vLLM."""
    if device_type != "cpu" or distributed:
        return None
    return "fork" if torch_threads == 1 else None


def worker_nice() -> int:
    value = os.environ.get(WORKER_NICE_ENV)
    if value is not None:
        return int(value)
    from vllm.platforms import current_platform

    # On GPUs the worker waits on the device and a spinning core rarely matters.
    return CPU_DEFAULT_WORKER_NICE if current_platform.is_cpu() else 0


def lower_worker_priority(nice: int) -> list[int]:
    """Renice every thread of this stage's vLLM workers (Linux nice is per thread); pids done."""
    import psutil

    done = []
    # vLLM's worker title, checked per supported vLLM minor (scripts/check_vllm_seams.py).
    worker_title = vllm_worker_title_prefix()
    for proc in psutil.Process().children(recursive=True):
        try:
            if not proc.name().startswith(worker_title):
                continue
            for thread in proc.threads():
                os.setpriority(os.PRIO_PROCESS, thread.id, nice)
            done.append(proc.pid)
        except (psutil.Error, OSError):  # a worker gone meanwhile, or no permission
            continue
    return done


# VllmConfig sections and fields reported by `describe` (the ones a stage config sets).
_DESCRIBED = {
    "model_config": ("model", "dtype", "max_model_len", "enforce_eager", "seed", "tokenizer"),
    "cache_config": (
        "gpu_memory_utilization",
        "enable_prefix_caching",
        "block_size",
        "cache_dtype",
        "kv_cache_memory_bytes",
    ),
    "scheduler_config": (
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_chunked_prefill",
        "async_scheduling",
        "scheduler_cls",
    ),
    "parallel_config": (
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "distributed_executor_backend",
    ),
    "load_config": ("load_format", "download_dir"),
}


def _plain(value: Any) -> Any:
    """JSON-safe form of a config value (classes and enums by name)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return str(value)


class ARStageRunner(AsyncStageLoop):
    def __init__(self, init: StageInit, conn: Any):
        super().__init__(init, conn)
        # A pipeline's chat stage (Qwen3-Omni's thinker) needs no pipeline glue of its own.
        chat = get_pipeline(init.pipeline).chat_stage == self.stage_id
        self.glue = glue_for(init.pipeline, init.stage, chat_only=chat)
        self.chat_stage = chat
        # The thinker's hidden states per request (models/thinker_states), when the stage config
        # opts in (`additional_config: {omni_thinker_states: {}}`); keyed by the request id.
        self.thinker_states: thinker_states.ThinkerStatesStore | None = None
        self.engine = self.loop.run_until_complete(self._build_engine())

    async def _build_engine(self):
        from vllm import AsyncEngineArgs

        kwargs = self.init.stage.engine_kwargs()
        if self.chat_stage:
            kwargs = chat_stage_engine_args(kwargs)
        if kwargs.get("tokenizer"):
            kwargs["tokenizer"] = self.glue.engine_tokenizer(kwargs["tokenizer"])
        self.thinker_states = thinker_states.attach(kwargs)  # None unless opted in
        own = list(self.init.spec.logits_processors)
        if own:
            kwargs["logits_processors"] = [*(kwargs.get("logits_processors") or []), *own]
        engine = serve_engine(AsyncEngineArgs(**kwargs))
        self.thinker_media = ThinkerMedia(self.thinker_states, engine.model_config.hf_config)
        await self._warm_up(engine)
        nice = worker_nice()
        if nice > 0:
            pids = lower_worker_priority(nice)
            logger.info("vLLM worker(s) %s of stage %d at nice %d", pids, self.stage_id, nice)
        return engine

    async def _warm_up(self, engine) -> None:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=2, detokenize=False)
        async for _ in engine.generate({"prompt_token_ids": WARMUP_PROMPT}, params, "warmup"):
            pass
        # Sampled as served requests are: the checkpoint's defaults under the stage's.
        sampling = sampler_settings(
            engine.model_config.get_diff_sampling_param(), self.glue.defaults
        )
        vocab = engine.model_config.get_vocab_size()

        def request(length: int, request_id: str):
            params = SamplingParams(max_tokens=2, detokenize=False, **sampling)
            return text_prompt(length, vocab), params

        await warm_step_shapes(engine, request)

    def info(self) -> StageInfo:
        return StageInfo(
            kind="ar",
            pipeline=self.init.pipeline,
            model=self.init.stage.model_path,
            effective=self.describe(),
        )

    def describe(self) -> ARSettings:
        """The settings in effect, read back from the engine's own VllmConfig (plain values)."""
        cfg = self.engine.vllm_config
        out: dict[str, Any] = {}
        for section, names in _DESCRIBED.items():
            sub = getattr(cfg, section, None)
            out[section] = {n: _plain(getattr(sub, n, None)) for n in names}
        return ARSettings(**out, default_sampling_params=_plain(self.glue.defaults))

    # ---- driving the engine (the loop is loop.AsyncStageLoop's) ---------------------------
    def background(self) -> list:
        return [self._watch_engine(), self._publish_metrics()]

    async def _watch_engine(self) -> None:
        # An engine core that died between requests is noticed here, not by the next request.
        while True:
            await asyncio.sleep(ENGINE_CHECK_S)
            if getattr(self.engine, "errored", False):
                self._engine_died()

    async def _publish_metrics(self) -> None:
        # vLLM's own metrics live in this process's registry: hand them to the API server.
        while True:
            self.reply(EngineMetrics(self.stage_id, engine_metrics.snapshot()))
            await asyncio.sleep(ENGINE_METRICS_INTERVAL_S)

    # ---- vLLM's own chat/completion requests (GenerateText, ar_text.py) ---------------------
    def dispatch(self, msg: Any) -> None:
        if not isinstance(msg, GenerateText):
            return super().dispatch(msg)
        self.submitted += 1
        task = self.loop.create_task(self._run_text(msg))
        task.add_done_callback(_log_task_failure)
        self.tasks[msg.request_id] = task  # an Abort cancels it like any request

    async def _run_text(self, msg: GenerateText) -> None:
        try:
            result = await run_text(self.engine, msg, self.reply, self.pulse)
        finally:
            self.tasks.pop(msg.request_id, None)
            self._release_states(msg.request_id)
        if result is None:
            return  # aborted: AsyncLLM.generate aborted it in the engine
        if result.error is not None and getattr(self.engine, "errored", False):
            self._engine_died()
            return  # not this request's fault: the stage's death fails it with a 503
        self.reply(result)

    def engine_unfinished(self) -> int | None:
        """vLLM's own count of the requests its AsyncLLM still tracks (None if this vLLM
        does not say); an aborted generation leaves it when vLLM handles the abort."""
        processor = getattr(self.engine, "output_processor", None)
        count = getattr(processor, "get_num_unfinished_requests", None)
        return count() if callable(count) else None

    def refusal(self, exc: Exception) -> tuple[str, str | None] | None:
        # Only our typed refusals are the client's fault.
        if isinstance(exc, RequestValidationError):
            return exc.message, exc.field
        return super().refusal(exc)

    def on_request_error(self, msg: Submit, exc: Exception) -> bool:
        if getattr(self.engine, "errored", False):
            self._engine_died()
            return True  # not this request's fault: the stage's death fails it with a 503
        return False

    def on_abort(self, request_id: str) -> None:
        super().on_abort(request_id)
        self._release_states(request_id)

    def _release_states(self, request_id: str) -> None:
        # A request's thinker states live no longer than the request: whatever its consumer did
        # not take by its end (or abort) is dropped, and later steps' states for it too.
        if self.thinker_states is not None:
            self.thinker_states.release(request_id)

    async def run_request(self, msg: Submit) -> Result:
        try:
            return await self._run_request(msg)
        finally:
            self._release_states(msg.request_id)

    async def _run_request(self, msg: Submit) -> Result:
        if msg.params.chat_request:  # speech: vLLM's chat request, rendered by the API server
            return await speak_chat(self, msg)
        rid = msg.request_id
        prompt, params = self.glue.prepare(msg.params)  # token ids (+ multimodal data)
        final = None
        total = int(params.max_tokens or 0)
        sent = 0
        clock = TokenClock()  # the x-omni-stage-timings header's time to first token, per token
        # Cancelling this task (Abort) makes AsyncLLM.generate abort the request in vLLM.
        async for out in self.engine.generate(prompt, params, rid):
            final = out
            clock.saw(len(out.outputs[0].token_ids))
            # Sent as outputs arrive from vLLM's engine core, so a stuck engine (or a stopped
            # worker) stops the pulses; nothing here beats on a timer.
            self.pulse()
            if msg.params.stream:
                # Streaming: tokens generated so far, about every 5 % of max_tokens.
                done = len(out.outputs[0].token_ids)
                if done - sent >= max(1, total // 20) or (out.finished and done != sent):
                    sent = done
                    self.reply(Progress(rid, self.stage_id, "ar", done, max(total, done)))
        assert final is not None and final.finished
        token_ids = list(final.outputs[0].token_ids)
        payload = self.glue.to_payload(token_ids, msg.params)
        output = self.payloads.emit(payload, rid, self.stage_id, msg.to_stage, msg.out_connector)
        metrics = {"generated_tokens": len(token_ids), **clock.metrics()}
        return Result(rid, output=output, metrics=metrics)

    def _engine_died(self) -> None:
        # vLLM's engine core is gone (a device error, a crashed worker): every later request
        # would fail while this stage still looks ready. Stop serving: worker.main exits
        # non-zero, and the orchestrator fails the in-flight requests (503) and restarts us.
        self.fatal("its vLLM engine died")

    async def close_engine(self) -> None:
        # AsyncLLM's output handler awaits the engine core's outputs on this loop: cancelled
        # and awaited before the engine core closes its sockets, it ends as a cancelled task;
        # after, it would fail on the closed sockets ("AsyncLLM output_handler failed"), or be
        # closed pending when the loop closes (GeneratorExit inside it). shutdown() then cancels
        # the engine core client's own tasks here, on the running loop, and stops the engine
        # core; the base awaits those tasks.
        await _cancel_all([t for t in [getattr(self.engine, "output_handler", None)] if t])
        try:
            self.engine.shutdown()
        finally:
            if self.thinker_states is not None:
                self.thinker_states.close()
