"""Qwen3-Omni: the thinker (vLLM) writes text, the talker writes codec frames, Code2Wav speaks.

Every edge streams: the talker starts on the thinker's first tokens, Code2Wav on the talker's
first frames, and the API server sends the first audio while the thinker is still writing.
The three stages share one stream window (a consumer checks its inputs against its own).
A chat request without `modalities: ["audio"]` runs the thinker alone (`chat_stage`).
"""

from __future__ import annotations

from typing import Any

from vllm_omni_plugin.pipelines.topology import PipelineTopology, StageSpec

TALKER = 1
# The talker's defaults where its deploy settings give none. Its KV cache holds, per request, the
# prompt's positions, a short assistant head and one position per frame; it grows with the
# longest request up to max_model_len positions in each of max_num_seqs slots.
DEFAULT_MAX_FRAMES = 4096  # frames per answer (80 ms each: 5.5 min of audio)
DEFAULT_TALKER_MAX_MODEL_LEN = 8192  # prompt ids + head + frames
TALKER_HEAD_POSITIONS = 9  # the assistant head the talker adds after the prompt


def talker_lengths(talker: Any) -> tuple[int, int]:
    """(max_model_len, frame cap) of the talker stage's resolved config, defaults filled in."""
    return (
        talker.talker.max_model_len or DEFAULT_TALKER_MAX_MODEL_LEN,
        talker.sampling.max_tokens or DEFAULT_MAX_FRAMES,
    )


def speech_prompt_limit(stages: list[Any]) -> int:
    """Most prompt ids a speech request may have: the talker's max_model_len less its frame cap
    and head (`stages`: the deploy config's resolved stages)."""
    length, frames = talker_lengths(next(s for s in stages if s.stage_id == TALKER))
    return length - frames - TALKER_HEAD_POSITIONS


QWEN3_OMNI = PipelineTopology(
    key="qwen3_omni",
    stages=(
        StageSpec(
            stage_id=0,
            name="thinker",
            kind="ar",
            inputs=[],
            emits="token_ids",
            # vLLM maps the whole checkpoint's architecture to its thinker model.
            hf_architecture="Qwen3OmniMoeForConditionalGeneration",
            stream_output=True,
            stream_window=8,
        ),
        StageSpec(
            stage_id=1,
            name="talker",
            kind="talker",
            inputs=[0],
            emits="codec_frames",
            stream_output=True,
            stream_window=8,
        ),
        StageSpec(
            stage_id=2,
            name="code2wav",
            kind="code2wav",
            inputs=[1],
            emits="audio",
            final_output=True,
            stream_output=True,
            stream_window=8,
        ),
    ),
    hf_model_types=("qwen3_omni_moe",),
    hf_architectures=("Qwen3OmniMoeForConditionalGeneration",),
    chat_stage=0,
    audio_output=True,
    speech_prompt_limit=speech_prompt_limit,
    description="Qwen3-Omni: thinker (vLLM) -> talker -> Code2Wav, streamed",
)
