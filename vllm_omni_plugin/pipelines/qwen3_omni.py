"""Qwen3-Omni: the thinker (vLLM) writes text, the talker writes codec frames, Code2Wav speaks.

Every edge streams: the talker starts on the thinker's first tokens, Code2Wav on the talker's
first frames, and the API server sends the first audio while the thinker is still writing.
The three stages share one stream window (a consumer checks its inputs against its own).
A chat request without `modalities: ["audio"]` runs the thinker alone (`chat_stage`).
"""

from __future__ import annotations

from vllm_omni_plugin.pipelines.topology import PipelineTopology, StageSpec

_STAGES = "vllm_omni_plugin.stages.qwen3_omni"

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
            kind="ar",
            inputs=[0],
            emits="codec_frames",
            stream_output=True,
            stream_window=8,
            runner=f"{_STAGES}:TalkerStage",
            # Its own torch engine, not a vLLM one: what it reads of an AR stage's settings.
            settings=(
                "dtype",
                "max_num_seqs",
                "default_sampling_params.max_tokens",
                "default_sampling_params.temperature=0",
            ),
        ),
        StageSpec(
            stage_id=2,
            name="code2wav",
            kind="diffusion",
            inputs=[1],
            emits="audio",
            final_output=True,
            stream_output=True,
            stream_window=8,
            runner=f"{_STAGES}:Code2WavStage",
            settings=("dtype", "device", "max_batch_size", "max_num_seqs"),
        ),
    ),
    hf_model_types=("qwen3_omni_moe",),
    hf_architectures=("Qwen3OmniMoeForConditionalGeneration",),
    chat_stage=0,
    audio_output=True,
    description="Qwen3-Omni: thinker (vLLM) -> talker -> Code2Wav, streamed",
)
