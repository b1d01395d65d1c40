"""What a chat request that asks for speech must satisfy, checked before any stage is touched.

OpenAI's shape: `modalities: ["text", "audio"]` and `audio: {"voice": NAME, "format": FMT}`.
The media parts were held to the `serving:` bounds before (media_limits.py, for every chat
request, off the event loop). Each refusal is an APIError 400 (OpenAI's error object) naming the field:

- speech asked of a deployment whose pipeline does not speak;
- `audio` without "audio" in `modalities`, or `modalities` with anything but "text"/"audio"
  (refused for text answers too: `check_modalities`);
- a voice that is not one of the checkpoint's speakers (talker config `speaker_id`);
- a format outside audio_encode.FORMATS, or a streamed answer in anything but pcm16 (what
  OpenAI streams);
- `n` > 1 (one voice answers once), a field of TEXT_ANSWER_ONLY set, or
  `stream_options.continuous_usage_stats` (a spoken stream reports its usage at the end);
- `speech_sampling` (the talker's sampling for this request, beside the chat's own settings)
  with a key outside SPEECH_SAMPLING or a value out of its range;
- speech asked for a prompt with embedding parts (`image_embeds`, ...: they carry no patch grid
  for the talker's 3-D positions; text, `input_audio`, `image_url` and `video_url` parts speak).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .audio_encode import FORMATS
from .errors import invalid

STREAM_FORMAT = "pcm16"
# Content parts a spoken answer may follow besides text (the talker reads the thinker's hidden
# states at their positions: stages/thinker_media.py).
SPOKEN_MEDIA = ("input_audio", "image_url", "video_url")
# Chat fields whose answer is beside the message (token ids, log probabilities, the echoed
# prompt): a text answer carries them, a spoken one does not, so with speech they are refused.
TEXT_ANSWER_ONLY = (
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "return_token_ids",
    "return_tokens_as_token_ids",
)
# The talker's per-request sampling (`extra_body={"speech_sampling": {...}}`): name -> check.
# Unset keys take the talker stage's `default_sampling_params`, then the checkpoint's; the
# chat request's own `seed` seeds the talker too unless `speech_sampling.seed` is set.
SPEECH_SAMPLING = {
    "temperature": (float, lambda v: v >= 0, "a number >= 0 (0: greedy)"),
    "top_k": (int, lambda v: v == -1 or v >= 1, "an integer >= 1, or -1 for all"),
    "top_p": (float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "repetition_penalty": (float, lambda v: v > 0, "a number > 0 (1: none)"),
    "seed": (int, lambda v: 0 <= v < 2**63, "an integer >= 0"),
}


@dataclass(frozen=True)
class SpeechRequest:
    """A checked request's speech settings."""

    voice: str  # the checkpoint's spelling of the speaker
    format: str
    stream: bool
    sampling: dict[str, float | int]  # the talker's, for this request (SPEECH_SAMPLING)


def checkpoint_voices(model_dir: str | Path) -> dict[str, str]:
    """The speakers of a Qwen3-Omni-style checkpoint: lower-cased name -> name as written in
    config.json's `talker_config.speaker_id`. Empty when the checkpoint has none."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    speakers = (config.get("talker_config") or {}).get("speaker_id") or {}
    return {str(name).lower(): str(name) for name in speakers}


def check_modalities(request: Any) -> list[str] | None:
    """The request's `modalities` (None when unset), or an APIError 400 for anything but a
    list of "text" and "audio" (OpenAI's values). Checked for every chat request: vLLM's own
    chat route would ignore the field."""
    modalities = (getattr(request, "model_extra", None) or {}).get("modalities")
    if modalities is None:
        return None
    if not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities):
        raise invalid('`modalities` must be a list such as ["text", "audio"]', "modalities")
    unknown = sorted(set(modalities) - {"text", "audio"})
    if unknown:
        raise invalid(f"unsupported modalities {unknown}; use text and audio", "modalities")
    return modalities


def check_speech_request(
    request: Any,
    *,
    speaks: bool,
    voices: dict[str, str],
    pipeline: str,
) -> SpeechRequest:
    """The request's SpeechRequest, or an APIError 400 (see the module docstring)."""
    extra = getattr(request, "model_extra", None) or {}
    if not speaks:
        raise invalid(
            f"this deployment ({pipeline}) answers in text only; drop `modalities: [..., "
            '"audio"]` and `audio`',
            "modalities",
            "unsupported_modality",
        )
    modalities = check_modalities(request)
    if modalities is None or "audio" not in modalities:
        raise invalid('`audio` needs "audio" in `modalities`', "modalities")
    audio = extra.get("audio")
    if not isinstance(audio, dict):
        raise invalid(
            'speech output needs `audio: {"voice": ..., "format": ...}`', "audio", "missing"
        )
    extra_keys = sorted(set(audio) - {"voice", "format"})
    if extra_keys:
        raise invalid(f"unsupported audio settings {extra_keys}", f"audio.{extra_keys[0]}")
    voice = audio.get("voice")
    if not isinstance(voice, str) or voice.lower() not in voices:
        known = ", ".join(sorted(voices.values())) or "none"
        raise invalid(f"unknown voice {voice!r}; this model speaks as: {known}", "audio.voice")
    fmt = audio.get("format")
    if fmt not in FORMATS:
        raise invalid(
            f"unsupported audio format {fmt!r}; supported: {', '.join(FORMATS)}", "audio.format"
        )
    stream = bool(getattr(request, "stream", False))
    if stream and fmt != STREAM_FORMAT:
        raise invalid(
            f"a streamed answer's audio is {STREAM_FORMAT}; set audio.format to {STREAM_FORMAT}",
            "audio.format",
        )
    if (getattr(request, "n", 1) or 1) > 1:
        raise invalid("n > 1 is not supported with audio output", "n")
    for name in TEXT_ANSWER_ONLY:
        if getattr(request, name, None) not in (None, False, 0):
            raise invalid(f"{name} is not supported with audio output", name)
    # A spoken stream reports usage once, at its end: its deltas are not counted in tokens.
    if getattr(getattr(request, "stream_options", None), "continuous_usage_stats", False):
        raise invalid(
            "stream_options.continuous_usage_stats is not supported with audio output; "
            "include_usage reports the usage at the end",
            "stream_options.continuous_usage_stats",
        )
    # The talker speaks the assistant turn the generation prompt opens: without it there is no
    # turn to speak (and a continued final message is not the thinker's answer alone).
    if getattr(request, "add_generation_prompt", True) is False:
        raise invalid("audio output needs add_generation_prompt: true", "add_generation_prompt")
    if getattr(request, "continue_final_message", False):
        raise invalid("audio output does not continue a final message", "continue_final_message")
    unspoken = [m for m in media_parts(getattr(request, "messages", [])) if m not in SPOKEN_MEDIA]
    if unspoken:
        # Embedding parts carry no patch grid of their own for the talker's 3-D positions.
        raise invalid(
            f"speech answers to {unspoken[0]} inputs are not supported yet; send text, "
            'input_audio, image_url and video_url parts with `modalities: ["text", "audio"]`, '
            "or drop `audio` for a text answer",
            "messages",
            "unsupported_modality",
        )
    sampling = speech_sampling(extra.get("speech_sampling"), getattr(request, "seed", None))
    return SpeechRequest(voices[voice.lower()], fmt, stream, sampling)


def speech_sampling(raw: Any, chat_seed: int | None) -> dict[str, float | int]:
    """The checked `speech_sampling` object (see SPEECH_SAMPLING), with the chat's seed."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise invalid("`speech_sampling` must be an object", "speech_sampling")
    out: dict[str, float | int] = {}
    for key, value in raw.items():
        if key not in SPEECH_SAMPLING:
            raise invalid(
                f"unknown speech_sampling setting {key!r}; known: {', '.join(SPEECH_SAMPLING)}",
                f"speech_sampling.{key}",
            )
        kind, ok, wanted = SPEECH_SAMPLING[key]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or (kind is int and not isinstance(value, int)) or not ok(value):
            raise invalid(f"speech_sampling.{key} must be {wanted}", f"speech_sampling.{key}")
        out[key] = kind(value)
    if chat_seed is not None and "seed" not in out:
        out["seed"] = int(chat_seed)
    return out


def media_parts(messages: Any) -> list[str]:
    """The types of the non-text content parts of the messages ("input_audio", "image_url"...)."""
    return [
        str(part.get("type"))
        for message in messages or []
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") not in ("text", None)
    ]
