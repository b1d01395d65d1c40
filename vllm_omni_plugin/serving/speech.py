"""Chat completions that answer with speech (`modalities: ["text", "audio"]`).

The request is checked first (speech_request.py: 400s before any stage is touched), then
rendered by vLLM's own chat handler (`OpenAIServingChat.render_chat_request`: the chat template,
multimodal content parsing and processing, vLLM's own 400s for bad content) and turned into
vLLM's EngineCoreRequest for the chat stage with vLLM's sampling parameters, exactly as a
text-only request is. The pipeline then speaks it (a SpeechSource: the chat stage writes the
transcript, the later stages the waveform) and the answer takes OpenAI's shape
(speech_shapes.py). A client that hangs up cancels the request in every stage.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..common.messages import ChatPrompt
from .audio_encode import encode_audio, to_pcm16
from .errors import APIError, unavailable
from .speech_events import AudioDelta, SpeechDone, SpeechSource, TranscriptDelta
from .speech_metrics import SpeechTimer
from .speech_request import SpeechRequest, check_speech_request
from .speech_shapes import DONE, ChunkWriter, completion_body, error_chunk
from .text_engine import encode_engine_request

logger = logging.getLogger("vllm_omni_plugin.serving")


class ClientGone(Exception):
    pass


def chat_prompt(request: Any) -> ChatPrompt:
    """What the talker reads of the chat stage's EngineCoreRequest: the prompt's ids and the
    patch grid of each image and video (vLLM's processed items, in prompt order), the input of
    the talker's 3-D positions (models/qwen3_omni/positions.py). ValueError (a 400) for a
    visual item without its grid or a video without its frame timing."""
    grids = []
    for feature in sorted(request.mm_features or [], key=lambda f: f.mm_position.offset):
        if feature.modality not in ("image", "video"):
            continue
        data = feature.data.get_data() if feature.data is not None else {}
        grid = data.get(f"{feature.modality}_grid_thw")
        if grid is None:
            raise ValueError(f"the chat request's {feature.modality} has no patch grid")
        t, h, w = (int(v) for v in grid.reshape(-1).tolist())
        # The processor's `video_second_per_grid`, which vLLM's Qwen-Omni processors keep as
        # `second_per_grid_ts`; images have none (their grid has one time step).
        seconds = data.get("second_per_grid_ts", data.get("video_second_per_grid"))
        if seconds is None and feature.modality == "video":
            raise ValueError("the chat request's video has no frame timing")
        seconds = float(seconds.reshape(-1)[0]) if seconds is not None else 1.0
        grids.append((t, h, w, seconds))
    return ChatPrompt(list(request.prompt_token_ids or []), grids)


class SpeechService:
    def __init__(
        self,
        *,
        text: Any,  # text_engine.TextEngine of the chat stage
        source: SpeechSource | None,  # None: the pipeline does not speak
        voices: dict[str, str],
        pipeline: str,
        healthy: Any,  # () -> bool
        max_prompt_ids: int | None = None,  # the speech stages' room for a prompt
    ):
        self.text = text
        self.source = source
        self.voices = voices
        self.pipeline = pipeline
        self.healthy = healthy
        self.max_prompt_ids = max_prompt_ids
        self.outcomes: Counter[str] = Counter()  # status code -> count, for /metrics
        self.timer = SpeechTimer(pipeline)

    def check(self, request: Any) -> SpeechRequest:
        speech = check_speech_request(
            request,
            speaks=self.source is not None,
            voices=self.voices,
            pipeline=self.pipeline,
        )
        if not self.healthy():
            raise unavailable("a stage of the pipeline is restarting; retry shortly")
        return speech

    async def create(self, request: Any, raw_request: Any) -> Response:
        try:
            speech = self.check(request)
        except APIError as exc:
            self.outcomes[str(exc.status)] += 1
            return JSONResponse(exc.body(), status_code=exc.status)
        chat = raw_request.app.state.openai_serving_chat
        rendered = await chat.render_chat_request(request)
        if not isinstance(rendered, tuple):  # vLLM's ErrorResponse (e.g. unknown model)
            self.outcomes[str(rendered.error.code)] += 1
            return JSONResponse(rendered.model_dump(), status_code=rendered.error.code)
        _conversation, engine_inputs = rendered
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            engine_request, prompt, prompt_text = self._engine_request(
                chat, request, engine_inputs[0], request_id
            )
        except (ValueError, APIError) as exc:  # vLLM's request validation (InputProcessor), ours
            err = (
                exc if isinstance(exc, APIError) else APIError(400, str(exc), code="invalid_value")
            )
            self.outcomes[str(err.status)] += 1
            return JSONResponse(err.body(), status_code=err.status)
        model = request.model or self.text.model_config.served_model_name
        assert self.source is not None
        events = self.source.speak(
            request_id, engine_request, prompt, prompt_text, speech.voice, speech.sampling
        )
        if speech.stream:
            options = getattr(request, "stream_options", None)
            include_usage = bool(getattr(options, "include_usage", False))
            writer = ChunkWriter(request_id, model, f"audio_{request_id}", include_usage)
            return StreamingResponse(self._stream(events, writer), media_type="text/event-stream")
        try:
            body = await self._collect(events, speech, request_id, model, raw_request)
        except APIError as exc:
            self.outcomes[str(exc.status)] += 1
            return JSONResponse(exc.body(), status_code=exc.status)
        except ClientGone:
            self.outcomes["499"] += 1
            return Response(status_code=499)
        self.outcomes["200"] += 1
        return JSONResponse(body)

    def _engine_request(
        self, chat: Any, request: Any, engine_input: Any, request_id: str
    ) -> tuple[list[bytes], ChatPrompt, str | None]:
        """The chat stage's EngineCoreRequest for the request, with vLLM's sampling parameters
        as vLLM's chat handler makes them, encoded; what the talker reads of it; the prompt's
        text."""
        from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
        from vllm.renderers.inputs.preprocess import extract_prompt_components
        from vllm.sampling_params import RequestOutputKind

        prompt_text, prompt_ids, _ = extract_prompt_components(self.text.model_config, engine_input)
        n = len(prompt_ids or [])
        if self.max_prompt_ids is not None and n > self.max_prompt_ids:
            raise APIError(
                400,
                f"the prompt has {n} tokens; a speech answer takes at most {self.max_prompt_ids} "
                "(the speech stages' max_model_len less their frame cap)",
                param="messages",
                code="context_length_exceeded",
            )
        max_tokens = get_max_tokens(
            self.text.model_config.max_model_len,
            request.max_completion_tokens
            if request.max_completion_tokens is not None
            else request.max_tokens,
            len(prompt_ids or []),
            chat.default_sampling_params,
            getattr(chat, "override_max_tokens", None),
            truncate_prompt_tokens=request.truncate_prompt_tokens,
        )
        params = request.to_sampling_params(max_tokens, chat.default_sampling_params)
        # The transcript streams as the chat stage writes it, whatever the answer's own mode.
        params.output_kind = RequestOutputKind.DELTA
        engine_request = self.text.engine_request(engine_input, params, request_id)
        return encode_engine_request(engine_request), chat_prompt(engine_request), prompt_text

    async def _collect(
        self, events: AsyncIterator[Any], speech: SpeechRequest, rid: str, model: str, raw: Any
    ) -> dict[str, Any]:
        work = asyncio.ensure_future(self._gather(events))
        gone = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            work.cancel()  # closes the source: the request is cancelled in every stage
            logger.info("speech request %s cancelled: client disconnected", rid)
            raise ClientGone(rid)
        transcript, samples, done = _result(work)
        sample_rate = self.source.sample_rate if self.source else 0
        audio = await asyncio.to_thread(encode_audio, samples, sample_rate, speech.format)
        return completion_body(
            request_id=rid,
            model=model,
            created=int(time.time()),
            audio_id=f"audio_{rid}",
            audio=audio,
            transcript=transcript,
            finish_reason=done.finish_reason,
            prompt_tokens=done.prompt_tokens,
            completion_tokens=done.completion_tokens,
        )

    async def _gather(self, events: AsyncIterator[Any]) -> tuple[str, np.ndarray, SpeechDone]:
        texts: list[str] = []
        pieces: list[np.ndarray] = []
        done = None
        timing = self.timer.start(self.source.sample_rate if self.source else 0)
        async for event in events:
            if isinstance(event, TranscriptDelta):
                texts.append(event.text)
            elif isinstance(event, AudioDelta):
                timing.audio(len(event.samples))
                pieces.append(np.asarray(event.samples, dtype=np.float32).reshape(-1))
            elif isinstance(event, SpeechDone):
                done = event
        if done is None:
            raise APIError(
                500, "the pipeline ended without finishing the answer", code="stage_error"
            )
        timing.finish()
        samples = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        return "".join(texts), samples, done

    async def _stream(self, events: AsyncIterator[Any], writer: ChunkWriter) -> AsyncIterator[str]:
        outcome = "499"
        timing = self.timer.start(self.source.sample_rate if self.source else 0)
        try:
            yield writer.role()
            done = None
            async for event in events:
                if isinstance(event, TranscriptDelta):
                    if event.text:
                        yield writer.transcript(event.text)
                elif isinstance(event, AudioDelta):
                    timing.audio(len(event.samples))
                    yield writer.audio(to_pcm16(event.samples))
                elif isinstance(event, SpeechDone):
                    done = event
            if done is None:
                raise APIError(500, "the pipeline ended without finishing the answer")
            timing.finish()
            yield writer.finish(done.finish_reason)
            if writer.include_usage:
                yield writer.usage(done.prompt_tokens, done.completion_tokens)
            outcome = "200"
            yield DONE
        except APIError as exc:
            outcome = str(exc.status)
            yield error_chunk(exc.body())
            yield DONE
        except Exception as exc:  # a stage failed or died after the 200 went out
            from ..orchestrator import StageUnavailableError

            # Its subclasses too: a lost Ray replica (ReplicaLostError) is a 503 as well.
            outcome = "503" if isinstance(exc, StageUnavailableError) else "500"
            status = int(outcome)
            yield error_chunk(APIError(status, str(exc)).body())
            yield DONE
        finally:
            close = getattr(events, "aclose", None)
            if close is not None:
                await close()  # cancels the request in every stage if it is still running
            self.outcomes[outcome] += 1


def _result(work: asyncio.Future) -> tuple[str, np.ndarray, SpeechDone]:
    from ..orchestrator import StageRequestError, StageUnavailableError

    try:
        return work.result()
    except StageUnavailableError as exc:
        raise unavailable(str(exc)) from None
    except StageRequestError as exc:
        raise APIError(500, str(exc), code="stage_error") from None


async def _wait_disconnect(request: Any) -> None:
    # The body is read (FastAPI parsed it), so the only message left is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
