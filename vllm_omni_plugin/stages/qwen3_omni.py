"""Qwen3-Omni's speech stages: the talker (thinker ids -> codec frames, vLLM's engine running
the talker model) and Code2Wav (codec frames -> 24 kHz waveform, a batched torch engine), each
behind a streamed edge.

    thinker (vLLM, stage 0) ==int64 ids==> talker (1) ==int64 [G, n] frames==> Code2Wav (2)
                                                              ==float32 samples==> API server

(For a prompt with audio or images the thinker's first chunk is its hidden states at those
positions, `[media positions, hidden]` floats: stages/thinker_media.py.)

The talker stage drives an AsyncLLM: one task per request prefills from the request's own chat
request (vLLM's EngineCoreRequest, rendered by the API server's chat template), its voice and
the thinker's first token, streams the rest of the thinker's text into the engine's worker
(models/qwen3_omni/text_feed.py) and emits the frames as vLLM writes them. It reads the
thinker's stream to the end even after its own frame cap, so the thinker (and the transcript)
is never held back.

Code2Wav runs its engine's `step()` in one worker thread (`_drive`: every ready request of the
stage in one batch per step) while one asyncio task per request feeds the engine what arrives
on the request's input stream and emits what the engine wrote for it. A request's reader that
falls behind (its emitted chunks not consumed: the edge's credit window) holds that request in
the engine (`hold`), so no request buffers more than `_MAX_WAITING` outputs, and the others go on.
Outputs that queued up meanwhile leave as one chunk (`merge`): under load a request's samples
cross the edge in fewer, larger chunks; alone, each leaves as soon as it is made.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..common.messages import EngineSettings, Result, StageInfo, Submit
from ..pipelines.qwen3_omni import talker_lengths
from .engine_warmup import warm_step_shapes
from .loop import AsyncStageLoop, RequestRefused

logger = logging.getLogger("vllm_omni_plugin.stages.qwen3_omni")

_MAX_WAITING = 4  # engine outputs of one request waiting for its reader before it is held
_IDLE_WAIT_S = 0.05  # nothing was ready: wait this long for news before stepping again
_ENGINE_CHECK_S = 1.0  # how often the talker stage checks that its vLLM engine core is alive
# The talker's sampling settings a stage's `default_sampling_params` may set (the rest of a
# request's frame sampling is fixed: talker_runner.frame_sampling_params).
TALKER_SAMPLING_KEYS = (
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "seed",
    "min_tokens",  # frames before the codec EOS may end the speech
)
_V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def talker_sampling(stage: Any) -> dict[str, Any]:
    """The talker stage's sampling defaults (set keys only; the checkpoint's where unset)."""
    return {k: v for k, v in stage.sampling.sampling_kwargs().items() if k in TALKER_SAMPLING_KEYS}


def talker_engine_kwargs(stage: Any, text_endpoint: str) -> dict[str, Any]:
    """vLLM engine arguments of the talker stage: its deploy settings, plus what the talker
    model needs (built from the checkpoint's talker_config, prompts given as embeddings, frames
    out through the talker worker's runner, the thinker's text through the feed)."""
    from ..models.qwen3_omni.talker_runner import talker_engine_args
    from ..models.qwen3_omni.text_feed import ADDITIONAL_CONFIG_KEY

    kwargs = stage.engine_kwargs()
    # The talker's runner subclasses vLLM's V1 model runner, which every supported vLLM has.
    os.environ[_V2_RUNNER_ENV] = "0"
    kwargs.pop("tokenizer", None)
    kwargs.pop("scheduler_cls", None)  # vLLM's own scheduler
    kwargs.update(
        talker_engine_args(),
        max_model_len=talker_lengths(stage)[0],
        additional_config={
            **(kwargs.get("additional_config") or {}),
            ADDITIONAL_CONFIG_KEY: {"endpoint": text_endpoint},
        },
    )
    return kwargs


class _BatchedEngineStage(AsyncStageLoop):
    """An engine with add/abort/hold/has_unfinished/step stepped in a worker thread; one
    output queue per request (see the module docstring)."""

    engine: Any

    def __init__(self, init: Any, conn: Any):
        super().__init__(init, conn)
        self.outputs: dict[str, asyncio.Queue] = {}
        self.news = asyncio.Event()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"omni-stage-{self.stage_id}")

    def info(self) -> StageInfo:
        return StageInfo(self.kind, EngineSettings(dataclasses.asdict(self.engine.config)))

    def background(self) -> list:
        return [self._drive()]

    async def _drive(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self.news.clear()
                await self.news.wait()
                continue
            self.news.clear()
            try:
                outputs = await self.loop.run_in_executor(self.executor, self.engine.step)
            except Exception as exc:  # the engine's state is unknown: restart the stage
                logger.exception("stage %d: engine step failed", self.stage_id)
                self.fatal(f"engine step failed: {type(exc).__name__}: {exc}")
                return
            self.pulse()
            for out in outputs:
                queue = self.outputs.get(out.request_id)
                if queue is None:
                    continue
                queue.put_nowait(out)
                if queue.qsize() >= _MAX_WAITING:
                    self.engine.hold(out.request_id, True)
            if not outputs:  # requests wait for input: step again when some arrives
                try:
                    await asyncio.wait_for(self.news.wait(), _IDLE_WAIT_S)
                except TimeoutError:
                    pass

    async def next_output(self, request_id: str) -> Any:
        """The request's next output: every one waiting, merged (at least one)."""
        queue = self.outputs[request_id]
        outs = [await queue.get()]
        while not queue.empty():
            outs.append(queue.get_nowait())
        self.engine.hold(request_id, False)
        self.news.set()
        return outs[0] if len(outs) == 1 else self.merge(outs)

    def merge(self, outs: list) -> Any:
        """One output holding `outs` (consecutive outputs of one request), in order."""
        raise NotImplementedError

    async def serve_request(self, msg: Submit, feed, emit) -> int:
        """Run `feed()` (input stream -> engine) beside a loop emitting the request's outputs
        with `emit(out)` (which returns what it counts of them) until its last; returns the
        sum of those counts."""
        rid = msg.request_id
        self.outputs[rid] = asyncio.Queue()
        feeder = asyncio.ensure_future(feed())
        getting: asyncio.Future | None = None
        emitted = 0
        try:
            while True:
                getting = asyncio.ensure_future(self.next_output(rid))
                await asyncio.wait({getting, feeder}, return_when=asyncio.FIRST_COMPLETED)
                if not getting.done():  # the feeder ended first: fine unless it failed
                    if feeder.exception() is not None:
                        getting.cancel()
                        raise feeder.exception()
                    await getting
                out = getting.result()
                emitted += await emit(out)
                if out.finished:
                    break
            await feeder  # the input stream to its end (and its errors)
        finally:
            feeder.cancel()
            if getting is not None:
                getting.cancel()
            self.outputs.pop(rid, None)
            self.engine.abort(rid)
            self.news.set()
        return emitted

    async def close_engine(self) -> None:
        # `_drive` is cancelled by now; a step it started may still run in the thread.
        self.executor.shutdown(wait=True, cancel_futures=True)


class TalkerStage(AsyncStageLoop):
    """Thinker ids in, codec frames out: the talker model on vLLM's own engine
    (models/qwen3_omni/talker.py), many requests per step; at most `max_tokens` frames.

    A request starts on the thinker's first id (its prefill embeds the prompt and that id,
    models/qwen3_omni/prompt.py; for a prompt with media, also the thinker's hidden states at
    those positions, which arrive before the ids (stages/thinker_media.py), on the 3-D
    positions of its images' grids); the rest of the thinker's text streams into the engine's
    worker through the text feed (models/qwen3_omni/text_feed.py) as it arrives, and frames
    leave as the engine writes them."""

    def __init__(self, init: Any, conn: Any):
        super().__init__(init, conn)
        from ..models.qwen3_omni.prompt import load_conditioner
        from ..models.qwen3_omni.text_feed import TextSender

        stage = init.stage
        self.max_model_len, self.max_frames = talker_lengths(stage)
        self.sampling = talker_sampling(stage)
        # The prefill conditioning runs here, beside the engine: the thinker's embedding and
        # the talker's projections only (the stage's device, the talker's dtype).
        dtype = stage.talker.dtype if stage.talker.dtype not in (None, "auto") else None
        device = _device()
        dtype = getattr(torch, dtype or ("bfloat16" if device == "cuda" else "float32"))
        self.conditioner = load_conditioner(stage.model_path, device, dtype)
        # One thread: requests' conditioning runs in arrival order, one device read each.
        self._conditioning = ThreadPoolExecutor(1, thread_name_prefix="talker-conditioning")
        self.talker_config = self.conditioner.config.talker_config
        self.text = TextSender()
        self.engine = self.loop.run_until_complete(self._build_engine())

    async def _build_engine(self):
        from vllm import AsyncEngineArgs

        from .ar_stage import lower_worker_priority, serve_engine, worker_nice

        kwargs = talker_engine_kwargs(self.init.stage, self.text.endpoint)
        engine = serve_engine(AsyncEngineArgs(**kwargs))
        await warm_step_shapes(engine, self._warmup_request)
        nice = worker_nice()  # as an AR stage's workers (ar_stage.py says why)
        if nice > 0:
            lower_worker_priority(nice)
        return engine

    def _warmup_request(self, length: int, request_id: str):
        """A talker request of `length` prompt embeddings whose text is complete (no feed),
        sampled as the stage samples, ending after two frames (engine_warmup.py)."""
        from ..models.qwen3_omni.talker_runner import frame_sampling_params

        width = self.conditioner.tts_pad.shape[-1]
        embeds = 0.02 * torch.randn(length, width, generator=torch.Generator().manual_seed(length))
        params = frame_sampling_params(
            self.talker_config, [0], 2, **{**self.sampling, "min_tokens": 0}
        )
        return {"prompt_embeds": embeds.to(self.conditioner.tts_pad.dtype)}, params

    def info(self) -> StageInfo:
        return StageInfo(self.kind, EngineSettings(self.init.stage.talker.model_dump()))

    def background(self) -> list:
        return [self._watch_engine()]

    async def _watch_engine(self) -> None:
        # An engine core that died between requests is noticed here, not by the next request.
        while True:
            await asyncio.sleep(_ENGINE_CHECK_S)
            if getattr(self.engine, "errored", False):
                self.fatal("its vLLM engine died")

    def engine_unfinished(self) -> int | None:
        processor = getattr(self.engine, "output_processor", None)
        count = getattr(processor, "get_num_unfinished_requests", None)
        return count() if callable(count) else None

    def on_request_error(self, msg: Submit, exc: Exception) -> bool:
        if getattr(self.engine, "errored", False):
            self.fatal("its vLLM engine died")
            return True  # not this request's fault: the stage's death fails it with a 503
        return False

    async def run_request(self, msg: Submit) -> Result:
        from vllm.sampling_params import RequestOutputKind

        from ..models.qwen3_omni.positions import VisualGrid
        from ..models.qwen3_omni.talker_runner import frame_sampling_params

        rid = msg.request_id
        prompt = msg.params.chat_prompt
        if prompt is None or len(msg.stream_inputs) != 1:
            raise RequestRefused("the talker takes a chat prompt on a streamed edge")
        prompt_ids = prompt.token_ids
        speakers = {k.lower(): v for k, v in self.talker_config.speaker_id.items()}
        speaker = speakers.get((msg.params.voice or "").lower())
        if speaker is None:
            raise RequestRefused(f"unknown voice {msg.params.voice!r}", "audio.voice")
        num_media = self.conditioner.media_positions(prompt_ids)
        try:
            self.conditioner.check_prompt(prompt_ids, has_hidden=num_media > 0)
        except ValueError as exc:
            raise RequestRefused(str(exc), "messages") from None
        positions = None  # 1-D
        grids = [VisualGrid(*grid) for grid in prompt.visual_grids]
        if grids:
            try:
                positions = self.conditioner.positions(prompt_ids, grids)
            except ValueError as exc:
                raise RequestRefused(str(exc), "messages") from None
        (source,) = msg.stream_inputs
        chunks = self.chunks(msg, source).__aiter__()
        media_hidden = None
        if num_media:  # the thinker's states at the media positions come first
            media_hidden = await self._media_hidden(chunks, num_media)
            if media_hidden is None:
                return Result(rid, metrics={"codec_frames": 0})
        first = await _next_ids(chunks)
        if not first:  # the thinker wrote nothing: nothing to say
            await _drain(chunks)
            return Result(rid, metrics={"codec_frames": 0})
        self.text.send(rid, first)
        # Off the event loop: the read of the device's result waits for this process's turn
        # on a GPU the engines keep busy, and meanwhile the loop goes on feeding the thinker's
        # text to the requests already speaking (every talker step waits for its text).
        prefill = await self.loop.run_in_executor(
            self._conditioning,
            lambda: self.conditioner.prefill(prompt_ids, first[0], speaker, media_hidden).cpu(),
        )
        params = frame_sampling_params(
            self.talker_config,
            rid,
            self.max_frames,
            positions,
            output_kind=RequestOutputKind.DELTA,
            **{**self.sampling, **msg.params.speech_sampling},
        )

        async def feed() -> None:
            # The thinker's text to its end, also after the last frame: the thinker (and the
            # transcript) is never held back by the talker.
            while ids := await _next_ids(chunks):
                self.text.send(rid, ids)
            self.text.send(rid, [], final=True)

        feeder = asyncio.ensure_future(feed())
        frames = 0
        try:
            prompt = {"prompt_embeds": prefill}
            async for out in self.engine.generate(prompt, params, rid):
                self.pulse()
                codes = self._frames(out.outputs[0].logprobs or [])
                if codes.shape[1]:
                    frames += codes.shape[1]
                    await self.emit_chunk(msg, codes)
            await feeder
        finally:
            feeder.cancel()
            self.text.close_request(rid)
        return Result(rid, metrics={"codec_frames": frames})

    async def _media_hidden(self, chunks, num_media: int) -> torch.Tensor | None:
        """The thinker's first chunk for a prompt with media: its hidden states there,
        `[num_media, thinker hidden]` (stages/thinker_media.py); None if the stream ended."""
        try:
            hidden = await chunks.__anext__()
        except StopAsyncIteration:
            return None
        width = self.conditioner.embed.weight.shape[-1]
        if not hidden.is_floating_point() or tuple(hidden.shape) != (num_media, width):
            raise RuntimeError(
                f"the thinker's media states are {hidden.dtype} {tuple(hidden.shape)}, not "
                f"[{num_media}, {width}] floats: is its stage's omni_thinker_states on?"
            )
        return hidden

    def _frames(self, logprobs: list) -> torch.Tensor:
        """New sample logprobs -> frames `[G, n]` (the codec EOS ends the speech: no frame)."""
        from ..models.qwen3_omni.talker_runner import frames_from_logprobs

        cfg = self.talker_config
        frames = frames_from_logprobs(
            logprobs,
            cfg.text_config.vocab_size,
            cfg.code_predictor_config.vocab_size,
            cfg.num_code_groups,
        )
        keep = frames[0] != cfg.codec_eos_token_id
        return frames if bool(keep.all()) else frames[:, keep]

    async def close_engine(self) -> None:
        # As the AR stage: AsyncLLM's output handler is cancelled before its sockets close.
        from .loop import _cancel_all

        await _cancel_all([t for t in [getattr(self.engine, "output_handler", None)] if t])
        self._conditioning.shutdown(wait=False, cancel_futures=True)
        try:
            self.engine.shutdown()
        finally:
            self.text.close()


async def _next_ids(chunks) -> list[int]:
    """The next chunk of thinker ids (empty at the stream's end)."""
    try:
        ids = await chunks.__anext__()
    except StopAsyncIteration:
        return []
    return [int(i) for i in ids.tolist()] or await _next_ids(chunks)


async def _drain(chunks) -> None:
    while await _next_ids(chunks):
        pass


class Code2WavStage(_BatchedEngineStage):
    """Codec frames in, float32 24 kHz samples out (code2wav/engine.py), chunks of several
    requests decoded together."""

    def __init__(self, init: Any, conn: Any):
        super().__init__(init, conn)
        from ..code2wav import Code2WavEngine, Code2WavEngineConfig

        settings = init.stage.code2wav
        self.engine = Code2WavEngine(
            Code2WavEngineConfig(
                model=init.stage.model_path,
                device=settings.device or _device(),
                dtype=settings.dtype,
                max_batch_size=settings.max_batch_size,
                enforce_eager=settings.enforce_eager,
            )
        )
        self.groups = self.engine.decoder.num_groups

    async def run_request(self, msg: Submit) -> Result:
        rid = msg.request_id
        if len(msg.stream_inputs) != 1:
            raise RequestRefused("Code2Wav takes codec frames on a streamed edge")
        self.engine.add_request(rid)
        (source,) = msg.stream_inputs
        samples = [0]

        async def feed() -> None:
            async for codes in self.chunks(msg, source):
                self.engine.add_frames(rid, codes)
                self.news.set()
            self.engine.add_frames(rid, torch.zeros(self.groups, 0, dtype=torch.long), True)
            self.news.set()

        async def emit(out: Any) -> int:
            if len(out.samples) == 0:
                return 0
            samples[0] += len(out.samples)
            await self.emit_chunk(msg, torch.from_numpy(out.samples))
            return 1

        chunks = await self.serve_request(msg, feed, emit)
        return Result(rid, metrics={"audio_chunks": chunks, "audio_samples": samples[0]})

    def merge(self, outs: list) -> Any:
        from ..code2wav import AudioChunk

        samples = np.concatenate([o.samples for o in outs])
        return AudioChunk(outs[0].request_id, samples, outs[-1].finished)
