"""OpenAI's chat-completion shapes for an answer with speech.

Non-streamed: `choices[0].message.audio = {id, data (base64 of the whole file), expires_at,
transcript}` with `message.content` null, as OpenAI's audio models answer. Streamed (SSE, ending
with `data: [DONE]`): a first chunk with the role, then chunks whose `delta.audio` holds the
answer's audio `id` and either a `transcript` piece or `data` (base64 pcm16 at 24 kHz), a last
chunk with `expires_at`, the finish reason, and the usage chunk when
`stream_options.include_usage` asks for it.

`expires_at` follows OpenAI's field; this server keeps no audio after answering, so an
assistant message that refers back to an earlier answer's audio by id is not supported.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

# What `expires_at` announces (OpenAI keeps answer audio for an hour).
AUDIO_TTL_S = 3600


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    *,
    request_id: str,
    model: str,
    created: int,
    audio_id: str,
    audio: bytes,
    transcript: str,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "refusal": None,
                    "audio": {
                        "id": audio_id,
                        "data": base64.b64encode(audio).decode("ascii"),
                        "expires_at": created + AUDIO_TTL_S,
                        "transcript": transcript,
                    },
                },
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage(prompt_tokens, completion_tokens),
    }


class ChunkWriter:
    """The SSE lines of one streamed answer."""

    def __init__(self, request_id: str, model: str, audio_id: str, include_usage: bool):
        self.request_id = request_id
        self.model = model
        self.audio_id = audio_id
        self.include_usage = include_usage
        self.created = int(time.time())

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> str:
        body = {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def role(self) -> str:
        return self._chunk({"role": "assistant", "content": None, "refusal": None})

    def transcript(self, text: str) -> str:
        return self._chunk({"audio": {"id": self.audio_id, "transcript": text}})

    def audio(self, pcm16: bytes) -> str:
        data = base64.b64encode(pcm16).decode("ascii")
        return self._chunk({"audio": {"id": self.audio_id, "data": data}})

    def finish(self, finish_reason: str | None) -> str:
        expires = self.created + AUDIO_TTL_S
        return self._chunk({"audio": {"id": self.audio_id, "expires_at": expires}}, finish_reason)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> str:
        return sse(
            {
                "id": self.request_id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage(prompt_tokens, completion_tokens),
            }
        )


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def error_chunk(body: dict[str, Any]) -> str:
    """An error after the stream started (vLLM's server streams errors the same way)."""
    return sse(body)


DONE = "data: [DONE]\n\n"
