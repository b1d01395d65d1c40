"""What the API server reads while a pipeline speaks one chat answer, in order.

A SpeechSource runs the request through the pipeline and yields TranscriptDelta (the chat
stage's text as it is written), AudioDelta (waveform pieces of the last stage, in order, as
they are decoded) and, last, SpeechDone. Closing the iterator early (the client hung up)
cancels the request in every stage.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..common.messages import ChatPrompt


@dataclass
class TranscriptDelta:
    text: str


@dataclass
class AudioDelta:
    samples: np.ndarray  # mono float32 in [-1, 1] at SpeechSource.sample_rate


@dataclass
class SpeechDone:
    finish_reason: str | None  # the chat stage's: "stop", "length"
    prompt_tokens: int
    completion_tokens: int  # the chat stage's text tokens


SpeechEvent = TranscriptDelta | AudioDelta | SpeechDone


class SpeechSource(Protocol):
    sample_rate: int

    def speak(
        self,
        request_id: str,
        engine_request: list[bytes],
        prompt: ChatPrompt,
        prompt_text: str | None,
        voice: str,
        sampling: dict[str, float | int],
    ) -> AsyncIterator[SpeechEvent]:
        """Run one request (vLLM's EngineCoreRequest for the chat stage, encoded as in
        common.messages.GenerateText, and what the talker reads of it) through the pipeline,
        speaking as `voice` with the talker's `sampling` settings for it."""
        ...
