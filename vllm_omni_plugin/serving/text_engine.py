"""vLLM's front end for a pipeline's chat stage, in the API server.

A pipeline whose topology names a `chat_stage` (a vLLM text generator, e.g. Qwen3-Omni's
thinker) answers /v1/chat/completions and /v1/completions with vLLM's own serving classes, as
`vllm serve` of that model alone would. What vLLM's AsyncLLM does in the API server process is
done here with the same vLLM parts: the stage's VllmConfig (from the same engine arguments the
stage builds its engine with), vLLM's renderer (chat templates, multimodal content parsing and
processing) and InputProcessor (request validation, EngineCoreRequest). What AsyncLLM hands its
engine core goes to the stage process instead (stages/ar_text.py), and the stage's outputs come
back as vLLM RequestOutputs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from ..common.text_messages import GenerateText, TextOutput
from ..orchestrator import StageUnavailableError

logger = logging.getLogger("vllm_omni_plugin.serving")

GENERATE_TASKS = ("generate",)
# ParallelConfig._api_process_count above 1: vLLM's processor-only multimodal cache.
FRONT_END_WITHOUT_MIRROR = 2


def encode_engine_request(request: Any) -> list[bytes]:
    """vLLM's msgpack frames of an EngineCoreRequest (its engine core's wire form): the message,
    then one buffer per large tensor of its multimodal features."""
    from vllm.v1.serial_utils import MsgpackEncoder

    return [bytes(b) for b in MsgpackEncoder().encode(request)]


def front_end_args(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The chat stage's engine arguments as this front end builds its config from them.

    vLLM's multimodal processor cache (`mm_processor_cache_gb`) is kept in the form vLLM gives it
    when several API servers share one engine core: processed items are kept here, so a
    repeated image, clip or video is not processed again, and each is still sent in full.
    vLLM's single-server form sends a repeat by key alone, trusting the engine core's mirror of
    this cache; the stage's engine core may have restarted since and hold none. vLLM's fault
    tolerance refuses more than one API server: with it on, this front end keeps no cache."""
    kwargs = dict(engine_kwargs)
    if kwargs.get("enable_fault_tolerance"):
        kwargs["mm_processor_cache_gb"] = 0
    else:
        kwargs["_api_process_count"] = FRONT_END_WITHOUT_MIRROR
    return kwargs


class _Collector:
    """One request's outputs between the stage's reader and vLLM's handler. Bounded: at most
    one output waits; a newer one is merged into it with vLLM's own `RequestOutput.add` (what
    vLLM's RequestOutputCollector does when its consumer lags)."""

    def __init__(self, aggregate: bool):
        self.aggregate = aggregate
        self.pending: Any = None
        self.closed = False
        self.ready = asyncio.Event()

    def put(self, out: Any) -> None:
        if self.pending is None:
            self.pending = out
        else:
            self.pending.add(out, aggregate=self.aggregate)
        self.ready.set()

    def close(self) -> None:
        self.closed = True
        self.ready.set()

    async def get(self) -> Any:
        """The next output, or None once the request ended and everything was taken."""
        while self.pending is None and not self.closed:
            self.ready.clear()
            await self.ready.wait()
        out, self.pending = self.pending, None
        return out


def rebuild_logprobs(positions: list | None) -> list | None:
    from vllm.logprobs import Logprob

    if positions is None:
        return None
    return [
        None
        if p is None
        else {
            t: Logprob(logprob=lp, rank=rank, decoded_token=tok) for t, (lp, rank, tok) in p.items()
        }
        for p in positions
    ]


class TextEngine:
    """The vLLM parts an EngineClient exposes (vllm_config, model_config, renderer,
    input_processor) for the chat stage, and `generate`, which runs on that stage."""

    def __init__(self, orchestrator: Any, stage_id: int):
        from vllm import AsyncEngineArgs
        from vllm.renderers import renderer_from_config
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.input_processor import InputProcessor

        from ..config.owners_ar import generation_config_overrides

        self.orchestrator = orchestrator
        self.stage_id = stage_id
        stage_cfg = orchestrator.cfg.stage(stage_id)
        kwargs = front_end_args(stage_cfg.engine_kwargs())
        # The stage's default_sampling_params are the defaults vLLM's own handlers apply.
        overrides = generation_config_overrides(stage_cfg.sampling)
        if overrides:
            kwargs["override_generation_config"] = {
                **(kwargs.get("override_generation_config") or {}),
                **overrides,
            }
        self.vllm_config = AsyncEngineArgs(**kwargs).create_engine_config(
            UsageContext.OPENAI_API_SERVER
        )
        self.model_config = self.vllm_config.model_config
        self.renderer = renderer_from_config(self.vllm_config)
        self.input_processor = InputProcessor(self.vllm_config, self.renderer)

    def shutdown(self) -> None:
        self.renderer.shutdown()

    def encode_request(
        self, prompt: Any, params: Any, request_id: str, **kwargs: Any
    ) -> list[bytes]:
        """`engine_request`, encoded with vLLM's msgpack encoder (its engine core's wire form)."""
        return encode_engine_request(self.engine_request(prompt, params, request_id, **kwargs))

    def engine_request(
        self,
        prompt: Any,
        params: Any,
        request_id: str,
        *,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """vLLM's EngineCoreRequest for a rendered prompt, as AsyncLLM.add_request makes it in
        vLLM's front end. Raises vLLM's own ValueErrors for invalid requests (a 400 in vLLM's
        server)."""
        request = self.input_processor.process_inputs(
            request_id,
            prompt,
            params,
            supported_tasks=GENERATE_TASKS,
            arrival_time=time.time(),
            tokenization_kwargs=tokenization_kwargs,
            trace_headers=trace_headers,
            priority=priority,
        )
        # As AsyncLLM.add_request sets them (fields of EngineCoreRequest in vLLM 0.26-0.33).
        if reasoning_ended is not None:
            request.reasoning_ended = reasoning_ended
        if reasoning_parser_kwargs is not None:
            request.reasoning_parser_kwargs = reasoning_parser_kwargs
        return request

    async def generate(
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        *,
        prompt_text: str | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        session_id: str | None = None,
        kv_hints: Any = None,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[Any, None]:
        """vLLM's EngineClient.generate: RequestOutputs of `prompt` from the chat stage."""
        from vllm.renderers.inputs.preprocess import extract_prompt_components
        from vllm.sampling_params import RequestOutputKind

        if lora_request is not None:
            raise ValueError("LoRA adapters are not supported by this pipeline's chat stage")
        if kv_hints is not None:
            raise ValueError("KV hints are not supported by this pipeline's chat stage")
        buffers = self.encode_request(
            prompt,
            sampling_params,
            request_id,
            tokenization_kwargs=tokenization_kwargs,
            trace_headers=trace_headers,
            priority=priority,
            reasoning_ended=reasoning_ended,
            reasoning_parser_kwargs=reasoning_parser_kwargs,
        )
        if prompt_text is None:
            prompt_text = extract_prompt_components(self.model_config, prompt)[0]
        msg = GenerateText(request_id, buffers, prompt_text)

        collector = _Collector(aggregate=sampling_params.output_kind == RequestOutputKind.DELTA)
        prompt_ids: list[list[int] | None] = [None]

        def on_output(out: Any) -> None:
            if isinstance(out, TextOutput):
                if out.prompt_token_ids is not None:
                    prompt_ids[0] = out.prompt_token_ids
                collector.put(self._request_output(out, prompt_text, prompt_ids[0]))

        stage = self.orchestrator.stages[self.stage_id]
        work = asyncio.ensure_future(stage.submit(msg, on_progress=on_output))
        work.add_done_callback(lambda _f: collector.close())
        try:
            while True:
                out = await collector.get()
                if out is None:
                    break
                yield out
            try:
                result = work.result()
            except StageUnavailableError as exc:
                # The stage died or stalls (it restarts): vLLM's server answers its own
                # EngineDeadError with a 503; our `errored` stays False, so it does not stop.
                from vllm.v1.engine.exceptions import EngineDeadError

                raise EngineDeadError(str(exc)) from None
            if result.error is not None:
                raise RuntimeError(f"stage {self.stage_id}: {result.error}")
        finally:
            if not work.done():
                work.cancel()  # the handler went away: abort the request in the stage

    @staticmethod
    def _request_output(out: TextOutput, prompt_text: str | None, prompt_ids: Any) -> Any:
        from vllm.outputs import CompletionOutput, RequestOutput

        completions = [
            CompletionOutput(
                index=c.index,
                text=c.text,
                token_ids=c.token_ids,
                cumulative_logprob=c.cumulative_logprob,
                logprobs=rebuild_logprobs(c.logprobs),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in out.outputs
        ]
        return RequestOutput(
            request_id=out.request_id,
            prompt=prompt_text,
            prompt_token_ids=prompt_ids,
            prompt_logprobs=rebuild_logprobs(out.prompt_logprobs),
            outputs=completions,
            finished=out.finished,
            num_cached_tokens=out.num_cached_tokens,
        )
