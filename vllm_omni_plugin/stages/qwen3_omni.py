"""Qwen3-Omni's speech stages: the talker (thinker ids -> codec frames) and Code2Wav (codec
frames -> 24 kHz waveform), each a batched torch engine behind a streamed edge.

    thinker (vLLM, stage 0) ==int64 ids==> talker (1) ==int64 [G, n] frames==> Code2Wav (2)
                                                              ==float32 samples==> API server

Each stage runs its engine's `step()` in one worker thread (`_drive`: every ready request of the
stage in one batch per step) while one asyncio task per request feeds the engine what arrives
on the request's input stream and emits what the engine wrote for it. A request's reader that
falls behind (its emitted chunks not consumed: the edge's credit window) holds that request in
the engine (`hold`), so no request buffers more than `_MAX_WAITING` outputs, and the others go on.
Outputs that queued up meanwhile leave as one chunk (`merge`): under load a request's frames
and samples cross the edge in fewer, larger chunks; alone, each leaves as soon as it is made.

The talker reads the prompt ids from the request's own chat request (vLLM's EngineCoreRequest,
rendered by the API server's chat template) and its voice; it reads the thinker's stream to
the end even after its own frame cap, so the thinker (and the transcript) is never held back.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..common.messages import Result, RunnerSettings, StageInfo, Submit
from ..pipelines.qwen3_omni import talker_lengths
from .loop import AsyncStageLoop, RequestRefused

logger = logging.getLogger("vllm_omni_plugin.stages.qwen3_omni")

_MAX_WAITING = 4  # engine outputs of one request waiting for its reader before it is held
_IDLE_WAIT_S = 0.05  # nothing was ready: wait this long for news before stepping again


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


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
        return StageInfo(self.kind, RunnerSettings(self.init.spec.runner or ""))

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


class TalkerStage(_BatchedEngineStage):
    """Thinker ids in, codec frames out (talker/engine.py), greedy, `max_tokens` frames at most."""

    def __init__(self, init: Any, conn: Any):
        super().__init__(init, conn)
        from ..talker import TalkerEngine

        stage = init.stage
        dtype = stage.model.dtype if stage.model.dtype not in (None, "auto") else None
        max_model_len, self.max_frames = talker_lengths(stage)
        device = _device()
        self.engine = TalkerEngine(
            stage.model_path,
            device,
            dtype or ("bfloat16" if device == "cuda" else "float32"),
            max_batch_size=stage.scheduler.max_num_seqs or 64,
            enforce_eager=bool(stage.runtime.enforce_eager),
            max_model_len=max_model_len,
        )

    async def run_request(self, msg: Submit) -> Result:
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.serial_utils import MsgpackDecoder

        rid = msg.request_id
        if not msg.params.chat_request or len(msg.stream_inputs) != 1:
            raise RequestRefused("the talker takes a chat request on a streamed edge")
        request = MsgpackDecoder(EngineCoreRequest).decode(msg.params.chat_request)
        from ..talker import TalkerPromptError

        try:
            self.engine.add_request(
                rid, list(request.prompt_token_ids or []), msg.params.voice or "", self.max_frames
            )
        except TalkerPromptError as exc:
            raise RequestRefused(str(exc), "messages") from None
        except ValueError as exc:
            raise RequestRefused(str(exc), "audio.voice") from None
        (source,) = msg.stream_inputs

        async def feed() -> None:
            open_ = True
            async for ids in self.chunks(msg, source):
                if open_:  # after the frame cap the rest of the thinker's text is only drained
                    open_ = self.engine.add_text(rid, [int(i) for i in ids.tolist()])
                    self.news.set()
            if open_:
                self.engine.add_text(rid, [], finished=True)
                self.news.set()

        async def emit(out: Any) -> int:
            if out.codes.shape[1] == 0:
                return 0
            await self.emit_chunk(msg, out.codes.contiguous())
            return out.codes.shape[1]

        frames = await self.serve_request(msg, feed, emit)
        return Result(rid, metrics={"codec_frames": frames})

    def merge(self, outs: list) -> Any:
        from ..talker import TalkerOutput

        codes = torch.cat([o.codes for o in outs], dim=1)
        return TalkerOutput(outs[0].request_id, codes, outs[-1].finished)


class Code2WavStage(_BatchedEngineStage):
    """Codec frames in, float32 24 kHz samples out (code2wav/engine.py), chunks of several
    requests decoded together."""

    def __init__(self, init: Any, conn: Any):
        super().__init__(init, conn)
        from ..code2wav import Code2WavEngine, Code2WavEngineConfig

        diffusion = init.stage.diffusion
        self.engine = Code2WavEngine(
            Code2WavEngineConfig(
                model=init.stage.model_path,
                device=diffusion.device or _device(),
                dtype=diffusion.dtype,
                max_batch_size=diffusion.max_batch_size,
                enforce_eager=bool(init.stage.runtime.enforce_eager),
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
