"""App state for a pipeline with a chat stage: the speech service behind the chat route's
speech branch (speech.py), the bounds on every chat request's media parts (media_limits.py),
and the pipeline's metrics on /metrics. vLLM's own state (chat, completions, /v1/models) is
built by vLLM's init_app_state (entry_points/patches.py, patch 3)."""

from __future__ import annotations

import argparse
from typing import Any

from ..pipelines import get_pipeline
from .engine_client import OmniEngineClient
from .media_limits import MediaLimits
from .metrics import OmniCollector, register
from .speech import SpeechService
from .speech_request import checkpoint_voices


def speech_source(client: OmniEngineClient) -> Any:
    """The pipeline's SpeechSource, or None when it does not speak."""
    if not get_pipeline(client.cfg.pipeline).audio_output:
        return None
    from .speech_source import PipelineSpeechSource

    return PipelineSpeechSource(client.orchestrator, client.cfg)


def init_speech_service(client: OmniEngineClient, state: Any, args: argparse.Namespace) -> None:
    serving = getattr(client.cfg, "serving", None)
    prompt_limit = get_pipeline(client.cfg.pipeline).speech_prompt_limit
    service = SpeechService(
        text=client.text,
        source=speech_source(client),
        voices=checkpoint_voices(client.cfg.model),
        max_prompt_ids=prompt_limit(client.cfg.stages) if prompt_limit else None,
        pipeline=client.cfg.pipeline,
        healthy=client.orchestrator.healthy,
    )
    state.omni_speech = service
    # The chat route's media bounds; file: URLs from the chat stage's allowed folder only.
    local_media = client.text.model_config.allowed_local_media_path
    state.omni_media_limits = MediaLimits.from_serving(serving, local_media)
    register(
        OmniCollector(
            client.orchestrator,
            service,
            client.cfg.pipeline,
            requests_metric="omni_speech_requests",
            requests_doc="Chat requests that asked for speech, by HTTP status",
        )
    )
