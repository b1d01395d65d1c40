"""The client side of the Qwen3-Omni speech benchmark (`bench_omni_speech.py`): streamed chat
requests through the official `openai` client, timed where a user hears them.

One speech request: `modalities=["text", "audio"]`, `audio={"voice", "format": "pcm16"}`,
`stream=True`, the thinker's length fixed by `max_tokens` + `ignore_eos` (the talker's frames
are capped by each server's configuration; a talker may still end at its own end-of-speech code
before the cap: `at_cap` says whether it ran to it). Per request:
- `ttfa_s`: request sent -> first audio bytes received (time to first audio packet);
- `wall_s`: request sent -> end of the stream (generation wall time);
- `audio_s`: seconds of audio received (pcm16 bytes / 2 / 24000); `frames`: the codec frames
  they came from (1920 samples each, less the decoder's fixed trim of under one frame);
- `rtf`: `wall_s / audio_s` (real-time factor; below 1 is faster than playback).
Both servers' stream shapes are read: ours (OpenAI's) carries `delta.audio.data` (base64 pcm16)
and `delta.audio.transcript`; vLLM-Omni 0.26 sends chunks with a top-level `modality` ("audio":
`delta.content` is base64 pcm16 of that chunk; "text": the text).

The question (`--input`): `text` (PROMPTS), `audio` (a 10 s spoken-question stand-in: an
`input_audio` WAV part, 16 kHz, then a text part) or `video` (a 30-frame question: a `video_url`
MP4 data URL, 320 x 240 at 2 frames per second, then a text part). Random weights answer noise as
well as speech; the media's cost (encoder, positions, hidden states) is what these measure.
`audio` and `video` send the same recording or clip with every request, so a server that keeps
processed media processes it once; `audio-new` and `video-new` send one the server has not seen
with every request (the noise or the gradients shifted by a process-wide counter), which also
measures processing the media. Each request's content is built before its clock starts.

One text request (`modalities=["text"]`, streamed, same length): the thinker's tokens per second,
overall (`tokens / wall_s`) and while decoding (`(tokens - 1) / (last - first token)`).

A failed request is a record with `ok: false` and its HTTP status (None: no HTTP answer), never
an exception: a load of 32 counts what did not complete.
"""

from __future__ import annotations

import base64
import functools
import io
import itertools
import statistics
import time
import wave
from dataclasses import dataclass

import numpy as np
import openai
from load_gen import closed_loop, percentile

SAMPLE_RATE = 24000  # Code2Wav's output rate (both systems)
SAMPLES_PER_FRAME = 1920  # one codec frame = 80 ms at 24 kHz
PROMPTS = [
    "Tell me a short story about a lighthouse keeper.",
    "Describe the weather on a stormy autumn evening.",
    "Explain how a bicycle stays upright.",
    "Give me three tips for learning to cook.",
    "What makes a good cup of tea?",
    "Describe a busy train station at rush hour.",
    "Why is the sky blue?",
    "Say something kind to a friend who had a long day.",
]


INPUTS = ("text", "audio", "video", "audio-new", "video-new")
AUDIO_QUESTION_S = 10.0
# Variants of the media questions no request of this process has sent yet (`*-new` inputs).
_UNSEEN = itertools.count(1)
VIDEO_QUESTION_FRAMES = 30


@functools.lru_cache(maxsize=2)
def audio_question_wav(variant: int = 0) -> bytes:
    """AUDIO_QUESTION_S of a gliding tone with noise (seeded by `variant`), 16-bit mono WAV at
    16 kHz."""
    rate = 16000
    t = np.arange(int(AUDIO_QUESTION_S * rate)) / rate
    wave_ = 0.3 * np.sin(2 * np.pi * (200 + 30 * t) * t)
    wave_ += 0.05 * np.random.default_rng(variant).standard_normal(t.shape)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(wave_, -1, 1) * 32767).astype("<i2").tobytes())
    return out.getvalue()


@functools.lru_cache(maxsize=2)
def video_question_mp4(variant: int = 0) -> bytes:
    """VIDEO_QUESTION_FRAMES frames of 320 x 240 moving gradients (offset by `variant`), MPEG-4
    at 2 fps."""
    import av

    ys, xs = np.mgrid[0:240, 0:320]
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=2)
        stream.width, stream.height, stream.pix_fmt = 320, 240, "yuv420p"
        for k in range(VIDEO_QUESTION_FRAMES):
            shift = 8 * k + 37 * variant
            rgb = np.stack([(xs + shift) % 256, (ys + 4 * k) % 256, (xs + ys + variant) % 256], -1)
            frame = av.VideoFrame.from_ndarray(rgb.astype(np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()


def user_content(i: int, media: str = "text") -> str | list[dict]:
    """The user turn of request `i`: PROMPTS[i] alone, or a media part and a question (`*-new`:
    media no earlier call of this process gave)."""
    if media == "text":
        return PROMPTS[i % len(PROMPTS)]
    if media not in INPUTS:
        raise ValueError(f"input {media!r}: one of {INPUTS}")
    kind, _, new = media.partition("-")
    variant = next(_UNSEEN) if new else 0
    if kind == "audio":
        data = base64.b64encode(audio_question_wav(variant)).decode()
        part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
        question = "Answer the question in the recording."
    else:
        url = "data:video/mp4;base64," + base64.b64encode(video_question_mp4(variant)).decode()
        part = {"type": "video_url", "video_url": {"url": url}}
        question = "What happens in this video?"
    return [part, {"type": "text", "text": question}]


@dataclass(frozen=True)
class Lengths:
    """The fixed answer length both systems produce."""

    thinker_tokens: int  # text tokens: request max_tokens with ignore_eos
    frames: int  # talker codec frames: each server's configured cap

    @property
    def audio_s(self) -> float:
        """Seconds of audio at the frame cap."""
        return self.frames * SAMPLES_PER_FRAME / SAMPLE_RATE


def _field(obj, name: str):
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    value = getattr(obj, name, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(name)
    return value


def audio_piece(chunk) -> tuple[bytes, str]:
    """A streamed chunk's audio bytes and transcript text, from either server's shape."""
    if not chunk.choices:
        return b"", ""
    delta = chunk.choices[0].delta
    audio = _field(delta, "audio")
    if audio is not None:  # ours: OpenAI's delta.audio
        data = _field(audio, "data")
        return (base64.b64decode(data) if data else b""), _field(audio, "transcript") or ""
    content = _field(delta, "content") or ""
    if _field(chunk, "modality") == "audio":  # vLLM-Omni: base64 pcm in content
        return (base64.b64decode(content) if content else b""), ""
    return b"", content


def _failure(exc: Exception, t0: float) -> dict:
    status = getattr(exc, "status_code", None)
    return {
        "ok": False,
        "status": status,
        "error": f"{type(exc).__name__}: {str(exc)[:200]}",
        "s": time.perf_counter() - t0,
    }


async def speech_request(
    client: openai.AsyncOpenAI,
    model: str,
    i: int,
    lengths: Lengths,
    voice: str = "ethan",
    media: str = "text",
) -> dict:
    """One streamed speech answer to request i's question (`user_content`); the timing record
    (module docstring)."""
    content = user_content(i, media)
    t0 = time.perf_counter()
    first = last = None
    nbytes, transcript = 0, []
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            modalities=["text", "audio"],
            audio={"voice": voice, "format": "pcm16"},
            stream=True,
            max_tokens=lengths.thinker_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            data, text = audio_piece(chunk)
            if data:
                now = time.perf_counter()
                first = now if first is None else first
                last = now
                nbytes += len(data)
            if text:
                transcript.append(text)
    except Exception as exc:  # counted, not raised: the load reports what did not complete
        return _failure(exc, t0)
    wall = time.perf_counter() - t0
    if not nbytes:
        return {"ok": False, "status": 200, "error": "no audio in the stream", "s": wall}
    samples = nbytes // 2
    audio_s = samples / SAMPLE_RATE
    return {
        "ok": True,
        "prompt": i % len(PROMPTS),
        "s": wall,
        "ttfa_s": first - t0,
        "last_audio_s": last - t0,
        "wall_s": wall,
        "samples": samples,
        "audio_s": audio_s,
        "rtf": wall / audio_s,
        # Code2Wav's output for N frames is N x 1920 samples less a fixed trim of its decoder's
        # convolutions (under one frame): the frames received are the samples rounded up.
        "frames": -(-samples // SAMPLES_PER_FRAME),
        "at_cap": -(-samples // SAMPLES_PER_FRAME) >= lengths.frames,
        "transcript_chars": len("".join(transcript)),
    }


async def text_request(client: openai.AsyncOpenAI, model: str, i: int, lengths: Lengths) -> dict:
    """One streamed text-only answer (the thinker alone): its token rate."""
    t0 = time.perf_counter()
    first = last = None
    tokens = pieces = 0
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            modalities=["text"],
            stream=True,
            max_tokens=lengths.thinker_tokens,
            temperature=0,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.usage is not None and chunk.usage.completion_tokens:
                tokens = chunk.usage.completion_tokens
            if _field(chunk, "modality") == "audio":  # not asked for; never text
                continue
            if chunk.choices and chunk.choices[0].delta.content:
                now = time.perf_counter()
                first = now if first is None else first
                last = now
                pieces += 1
    except Exception as exc:
        return _failure(exc, t0)
    wall = time.perf_counter() - t0
    tokens = tokens or pieces  # a server without usage in the stream: one token per piece
    if first is None:
        return {"ok": False, "status": 200, "error": "no text in the stream", "s": wall}
    decode = (tokens - 1) / (last - first) if tokens > 1 and last > first else None
    return {
        "ok": True,
        "s": wall,
        "ttft_s": first - t0,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "decode_tokens_per_s": decode,
    }


async def load(send, requests: int, concurrency: int) -> tuple[list[dict], float]:
    """`requests` requests through `concurrency` workers (load_gen's closed loop); each
    request's record and the wall time of the whole load."""
    records: list[dict] = []

    async def one(i: int) -> dict:
        rec = await send(i)
        records.append(rec)
        return rec

    result = await closed_loop(one, requests, concurrency)
    return records, result.wall_s


def _med(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def _p90(values) -> float | None:
    values = sorted(v for v in values if v is not None)
    return round(percentile(values, 90), 4) if values else None


def summarize_speech(records: list[dict], wall_s: float, concurrency: int) -> dict:
    """What one speech load measured: completion, TTFA and RTF (median, p90), audio seconds per
    wall second (all audio received over the load's wall time)."""
    ok = [r for r in records if r["ok"]]
    failed = [r for r in records if not r["ok"]]
    audio = sum(r["audio_s"] for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "completed": len(ok),
        "http_5xx": sum(1 for r in failed if (r.get("status") or 0) >= 500),
        "errors": [r["error"] for r in failed][:5],
        "wall_s": round(wall_s, 3),
        "ttfa_s": _med(r["ttfa_s"] for r in ok),
        "ttfa_p90_s": _p90(r["ttfa_s"] for r in ok),
        "rtf": _med(r["rtf"] for r in ok),
        "rtf_p90": _p90(r["rtf"] for r in ok),
        "audio_s": _med(r["audio_s"] for r in ok),
        "samples_by_prompt": {str(r["prompt"]): r["samples"] for r in ok},
        "at_cap": sum(1 for r in ok if r["at_cap"]),
        "audio_s_per_wall_s": round(audio / wall_s, 3) if wall_s > 0 else None,
    }


def summarize_text(records: list[dict]) -> dict:
    ok = [r for r in records if r["ok"]]
    return {
        "requests": len(records),
        "completed": len(ok),
        "http_5xx": sum(1 for r in records if not r["ok"] and (r.get("status") or 0) >= 500),
        "tokens": _med(r["tokens"] for r in ok),
        "ttft_s": _med(r["ttft_s"] for r in ok),
        "tokens_per_s": _med(r["tokens_per_s"] for r in ok),
        "decode_tokens_per_s": _med(r["decode_tokens_per_s"] for r in ok),
    }


def _per_stage(metrics_text: str, prefix: str) -> dict[str, float]:
    """Our /metrics: the samples whose line starts with `prefix`, summed by stage id."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith(prefix):
            labels, _, value = line.rpartition(" ")
            stage = labels.split('stage_id="', 1)[1].split('"', 1)[0]
            out[stage] = out.get(stage, 0.0) + float(value)
    return out


def stage_counter(metrics_text: str, name: str) -> dict[str, float] | None:
    """Our /metrics: a per-stage counter family (`omni_stage_<name>_total`) by stage id; None
    when the server exports no such family (vLLM-Omni 0.26)."""
    return _per_stage(metrics_text, f"omni_stage_{name}_total{{") or None


def stage_first_outputs(metrics_text: str) -> dict[str, tuple[float, float]] | None:
    """Our /metrics: per stage id, (summed seconds, requests) from receiving a request to its
    first streamed chunk (`omni_stage_time_to_first_output_seconds`); None when not exported."""
    name = "omni_stage_time_to_first_output_seconds"
    sums = _per_stage(metrics_text, name + "_sum{")
    counts = _per_stage(metrics_text, name + "_count{")
    return {k: (sums[k], counts.get(k, 0.0)) for k in sums} or None


def stage_restarts(metrics_text: str) -> int | None:
    """Our /metrics: the stage restarts so far (all stages); None when not exported."""
    per_stage = stage_counter(metrics_text, "restarts")
    return None if per_stage is None else int(sum(per_stage.values()))
