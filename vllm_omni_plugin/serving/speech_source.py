"""The pipeline as a SpeechSource (speech_events.py): one chat request through every stage.

The request enters as GenerationParams with `chat_request` (vLLM's EngineCoreRequest for the
chat stage), `chat_prompt` (what the talker reads of it) and `voice`. The chat stage sends its
text as TextOutput messages (the transcript, relayed to this request's progress listener as they
come) while its hidden states go on to the later stages; the last stage's waveform comes back
through the orchestrator's streamed edge to the API server (`Orchestrator.stream`: its chunks in
order, then the PipelineResult). Leaving the iteration early closes that stream, which cancels
the request in every stage.

The transcript is paced to the audio, as an audio transcript is: a text piece is sent once the
talker has read all its tokens for the audio already sent (codec frame k reads the thinker's
token k + 1, so F frames of audio cover F + 1 tokens), and what is left when the audio ends.
The first token goes out at once; the text runs a little ahead of the speech, never behind the
audio it describes.

Bounded: text pieces sent together are joined into one delta; the next audio chunk is taken
only when the reader asks for it (the last stage's stream window holds it back meanwhile).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from ..common.messages import ChatPrompt, GenerationParams
from ..common.text_messages import TextOutput
from .speech_events import AudioDelta, SpeechDone, SpeechEvent, TranscriptDelta

# Qwen3-Omni's Code2Wav: 24 kHz (1920 samples per codec frame).
DEFAULT_SAMPLE_RATE = 24000


DEFAULT_SAMPLES_PER_FRAME = 1920


def _code2wav_config(model_dir: str | Path) -> dict:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config.get("code2wav_config") or {}


def checkpoint_sample_rate(model_dir: str | Path) -> int:
    code2wav = _code2wav_config(model_dir)
    return int(code2wav.get("sampling_rate") or code2wav.get("sample_rate") or DEFAULT_SAMPLE_RATE)


def checkpoint_samples_per_frame(model_dir: str | Path) -> int:
    """Code2Wav's upsampling (transformers' `total_upsample`): samples per codec frame."""
    code2wav = _code2wav_config(model_dir)
    factors = list(code2wav.get("upsampling_ratios") or []) + list(
        code2wav.get("upsample_rates") or []
    )
    return int(np.prod(factors)) if factors else DEFAULT_SAMPLES_PER_FRAME


def waveform(payload: Any) -> np.ndarray:
    """A waveform chunk the last stage emitted (a tensor or an array of samples) as mono
    float32."""
    if hasattr(payload, "detach"):  # a torch tensor
        payload = payload.detach().to("cpu").float().numpy()
    if isinstance(payload, np.ndarray):
        return payload.astype(np.float32, copy=False).reshape(-1)
    raise TypeError(f"the last stage emitted {type(payload).__name__}, not a waveform")


class PipelineSpeechSource:
    def __init__(self, orchestrator: Any, cfg: Any):
        self.orchestrator = orchestrator
        self.sample_rate = checkpoint_sample_rate(cfg.model)
        self.samples_per_frame = checkpoint_samples_per_frame(cfg.model)

    async def speak(
        self,
        request_id: str,
        engine_request: list[bytes],
        prompt: ChatPrompt,
        prompt_text: str | None,
        voice: str,
        sampling: dict[str, float | int],
    ) -> AsyncIterator[SpeechEvent]:
        params = GenerationParams(
            prompt=prompt_text or "",
            chat_request=engine_request,
            chat_prompt=prompt,
            voice=voice,
            speech_sampling=sampling,
            stream=True,
        )
        text: list[tuple[str, int]] = []  # pieces not sent yet, with the thinker tokens they end at
        counts = {"prompt": 0, "completion": 0}
        finish: list[str | None] = [None]
        changed = asyncio.Event()

        def on_message(msg: Any) -> None:
            if not isinstance(msg, TextOutput):
                return  # a stage's Progress: nothing the chat answer shows
            if msg.prompt_token_ids is not None:
                counts["prompt"] = len(msg.prompt_token_ids)
            for c in msg.outputs:
                counts["completion"] += len(c.token_ids)
                text.append((c.text, counts["completion"]))
                finish[0] = c.finish_reason or finish[0]
            changed.set()

        samples_sent = 0

        def read_text() -> TranscriptDelta | None:
            """The pieces the talker has read for the audio sent so far, as one delta."""
            tokens_read = samples_sent // self.samples_per_frame + 1
            n = 0
            while n < len(text) and text[n][1] <= tokens_read:
                n += 1
            delta = "".join(piece for piece, _ in text[:n])
            del text[:n]
            return TranscriptDelta(delta) if n else None

        stream = self.orchestrator.stream(request_id, params, on_progress=on_message)
        pending = asyncio.ensure_future(stream.__anext__())
        waiter: asyncio.Future | None = None
        try:
            while True:
                waiter = asyncio.ensure_future(changed.wait())
                await asyncio.wait({pending, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                changed.clear()
                if (delta := read_text()) is not None:
                    yield delta
                if not pending.done():
                    continue
                try:
                    item = pending.result()
                except StopAsyncIteration:
                    break
                if hasattr(item, "payload") and hasattr(item, "seq"):  # an OutputChunk
                    samples = waveform(item.payload)
                    samples_sent += len(samples)
                    yield AudioDelta(samples)
                    if (delta := read_text()) is not None:
                        yield delta
                pending = asyncio.ensure_future(stream.__anext__())
            if text:  # the audio ended: the rest of the text
                yield TranscriptDelta("".join(piece for piece, _ in text))
            yield SpeechDone(finish[0], counts["prompt"], counts["completion"])
        finally:
            if waiter is not None:
                waiter.cancel()
            if not pending.done():
                # The stream cannot be closed while its __anext__ still runs in `pending`: the
                # cancelled step must end first.
                pending.cancel()
                await asyncio.wait({pending})
            if not pending.cancelled():
                pending.exception()  # already raised above, or moot once the caller left
            await stream.aclose()  # cancels the request in every stage if still running
