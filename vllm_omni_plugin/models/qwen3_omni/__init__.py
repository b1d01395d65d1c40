"""Qwen3-Omni's speech side (talker + Code2Wav), torch only: see `speech.py`."""

from .speech import SpeechGenerator, SpeechOutput

__all__ = ["SpeechGenerator", "SpeechOutput"]
