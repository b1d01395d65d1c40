"""An AR stage process: a vLLM AsyncLLM (stock engine, our model and scheduler) behind the
control socket. Requests decode together (continuous batching); each finished request's
output goes to the next stage through the edge's connector.

The pipeline-specific part (prompt building, sampling constraint, output -> payload) comes from
`ar_glue.py`, keyed by the topology.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from multiprocessing.connection import Connection
from typing import Any

from ..config.vllm_engine_fields import vllm_worker_title_prefix
from ..diffusion.errors import RequestValidationError
from . import engine_metrics
from .ar_glue import glue_for
from .messages import (
    ENGINE_METRICS_INTERVAL_S,
    PULSE_INTERVAL_S,
    Abort,
    EngineMetrics,
    Inspect,
    Inspection,
    Progress,
    Pulse,
    Result,
    Shutdown,
    StageInit,
    Submit,
)
from .payloads import StagePayloads

logger = logging.getLogger("vllm_omni_plugin.stages.ar")

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
CPU_DEFAULT_WORKER_NICE = 19

# How often the stage checks that its vLLM engine core is alive. One that died (a device error,
# a crashed worker) would fail every request while the stage looks ready: the stage exits
# instead, and the orchestrator restarts it.
ENGINE_CHECK_S = 1.0


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


def _log_task_failure(task: asyncio.Task) -> None:
    # `_run` turns request errors into Results; what still escapes (the reply's send) would
    # otherwise surface only as asyncio's "exception was never retrieved" at GC time.
    if not task.cancelled() and task.exception() is not None:
        logger.error("AR request task failed", exc_info=task.exception())


class ARStageRunner:
    def __init__(self, init: StageInit, conn: Connection):
        self.init = init
        self.conn = conn
        self.stage_id: int = init.stage.stage_id
        self.glue = glue_for(init.pipeline, init.stage)
        self.payloads = StagePayloads(init.connectors)
        self.tasks: dict[str, asyncio.Task] = {}
        self.submitted = 0  # Submits received (Inspection.submitted)
        self._pulsed = 0.0  # when the last Pulse went out (monotonic)
        self.loop = asyncio.new_event_loop()
        self.engine = self.loop.run_until_complete(self._build_engine())

    async def _build_engine(self):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = self.init.stage.engine_kwargs()
        own = list(self.init.spec.logits_processors)
        if own:
            kwargs["logits_processors"] = [*(kwargs.get("logits_processors") or []), *own]
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
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

    def info(self) -> dict[str, Any]:
        return {
            "kind": "ar",
            "pipeline": self.init.pipeline,
            "model": self.init.stage.model_path,
            "effective": self.describe(),
        }

    def describe(self) -> dict[str, Any]:
        """The settings in effect, read back from the engine's own VllmConfig (plain values)."""
        cfg = self.engine.vllm_config
        out: dict[str, Any] = {}
        for section, names in _DESCRIBED.items():
            sub = getattr(cfg, section, None)
            out[section] = {n: _plain(getattr(sub, n, None)) for n in names}
        out["default_sampling_params"] = _plain(self.glue.defaults)
        return out

    # ---- the loop ----------------------------------------------------------------------
    def serve(self) -> None:
        self._done = self.loop.create_future()
        self.loop.add_reader(self.conn.fileno(), self._on_readable)
        watch = self.loop.create_task(self._watch_engine())
        watch.add_done_callback(_log_task_failure)
        publish = self.loop.create_task(self._publish_metrics())
        publish.add_done_callback(_log_task_failure)
        try:
            self.loop.run_until_complete(self._done)
        finally:
            watch.cancel()
            publish.cancel()
            self.loop.remove_reader(self.conn.fileno())

    async def _watch_engine(self) -> None:
        # An engine core that died between requests is noticed here, not by the next request.
        while not self._done.done():
            await asyncio.sleep(ENGINE_CHECK_S)
            if getattr(self.engine, "errored", False):
                self._engine_died()

    async def _publish_metrics(self) -> None:
        # vLLM's own metrics live in this process's registry: hand them to the API server.
        while not self._done.done():
            self.conn.send(EngineMetrics(self.stage_id, engine_metrics.snapshot()))
            await asyncio.sleep(ENGINE_METRICS_INTERVAL_S)

    def _on_readable(self) -> None:
        try:
            while self.conn.poll(0):
                self._handle(self.conn.recv())
        except (EOFError, OSError):
            # The API server is gone: stop (the finally in worker.main cleans up).
            if not self._done.done():
                self._done.set_exception(EOFError())

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, Submit):
            self.submitted += 1
            task = self.loop.create_task(self._run(msg))
            task.add_done_callback(_log_task_failure)
            self.tasks[msg.request_id] = task
        elif isinstance(msg, Abort):
            task = self.tasks.pop(msg.request_id, None)
            if task is not None:
                task.cancel()
            # Also sent when the request failed or was cancelled after this stage finished it:
            # free its payload now rather than when the connector's lease expires.
            self.payloads.release_request(msg.request_id)
        elif isinstance(msg, Shutdown) and not self._done.done():
            self._done.set_result(None)
        elif isinstance(msg, Inspect):
            self.conn.send(
                Inspection(
                    msg.token,
                    self.stage_id,
                    {rid: {} for rid in self.tasks},
                    engine_unfinished=self._engine_unfinished(),
                    submitted=self.submitted,
                    at=time.time(),
                )
            )

    def _engine_unfinished(self) -> int | None:
        """vLLM's own count of the requests its AsyncLLM still tracks (None if this vLLM
        does not say); an aborted generation leaves it when vLLM handles the abort."""
        processor = getattr(self.engine, "output_processor", None)
        count = getattr(processor, "get_num_unfinished_requests", None)
        return count() if callable(count) else None

    async def _run(self, msg: Submit) -> None:
        t0 = time.perf_counter()
        rid = msg.request_id
        try:
            prompt, params = self.glue.prepare(msg.params)  # token ids (+ multimodal data)
            final = None
            total = int(params.max_tokens or 0)
            sent = 0
            async for out in self.engine.generate(prompt, params, rid):
                final = out
                self._pulse()
                if msg.params.stream:
                    # Streaming: tokens generated so far, about every 5 % of max_tokens.
                    done = len(out.outputs[0].token_ids)
                    if done - sent >= max(1, total // 20) or (out.finished and done != sent):
                        sent = done
                        self.conn.send(Progress(rid, self.stage_id, "ar", done, max(total, done)))
            assert final is not None and final.finished
            token_ids = list(final.outputs[0].token_ids)
            payload = self.glue.to_payload(token_ids, msg.params)
            output = self.payloads.emit(
                payload, rid, self.stage_id, msg.to_stage, msg.out_connector
            )
            result = Result(rid, output=output, metrics={"generated_tokens": len(token_ids)})
        except asyncio.CancelledError:
            return  # aborted: AsyncLLM.generate aborts the request in the engine on cancel
        except RequestValidationError as exc:  # only our typed refusals are the client's fault
            result = Result(rid, error=exc.message, error_field=exc.field)
        except Exception as exc:
            logger.exception("request %s failed", rid)
            result = Result(rid, error=f"{type(exc).__name__}: {exc}")
            if getattr(self.engine, "errored", False):
                self._engine_died()
                return  # not this request's fault: the stage's death fails it with a 503
        finally:
            self.tasks.pop(rid, None)
        result.stage_s = time.perf_counter() - t0
        self.conn.send(result)

    def _pulse(self) -> None:
        """Tell the orchestrator's stall watchdog that the engine produced tokens. Sent as
        outputs arrive from vLLM's engine core, so a stuck engine (or a stopped worker)
        stops the pulses; nothing here beats on a timer."""
        now = time.monotonic()
        if now - self._pulsed >= PULSE_INTERVAL_S:
            self._pulsed = now
            self.conn.send(Pulse(self.stage_id))

    def _engine_died(self) -> None:
        # vLLM's engine core is gone (a device error, a crashed worker): every later request
        # would fail while this stage still looks ready. Stop serving: worker.main exits
        # non-zero, and the orchestrator fails the in-flight requests (503) and restarts us.
        if not self._done.done():
            logger.critical(
                "stage %d: its vLLM engine died; exiting to be restarted", self.stage_id
            )
            self._done.set_exception(RuntimeError(f"stage {self.stage_id}: vLLM engine died"))

    def close(self) -> None:
        self.payloads.close()
        try:
            self.engine.shutdown()
        except Exception:
            pass
