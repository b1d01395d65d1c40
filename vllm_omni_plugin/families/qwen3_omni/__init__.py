"""Qwen3-Omni's talker as a vLLM model: the dotted names vLLM's registry and the talker stage
refer to without importing the model, and the config override that makes vLLM build the
talker out of the full checkpoint. Nothing here imports vLLM or torch."""

from __future__ import annotations

from typing import Any

TALKER_ARCH = "Qwen3OmniTalkerForCodecGeneration"
TALKER_CLASS = "vllm_omni_plugin.models.qwen3_omni.talker:Qwen3OmniTalkerForCodecGeneration"

# How the checkpoint samples (transformers' `Qwen3OmniMoeForConditionalGeneration.generate`):
# the talker's first code group with these defaults; the code predictor's groups with top-k 50,
# top-p 0.8 at its own generation config's temperature (1.0) and no repetition penalty,
# sampling whenever the talker samples (greedy when it is greedy).
TALKER_SAMPLING = {"temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05}
PREDICTOR_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 0.8}


def talker_hf_config(config: Any) -> Any:
    """vLLM's `hf_overrides` callable for the talker stage: the checkpoint's
    `Qwen3OmniMoeConfig` -> its `talker_config`, with our architecture. Its 3-D M-RoPE
    scheme stays: the talker's runner gives each request its positions
    (models/qwen3_omni/talker_runner.py).

    A module-level function so the engine config pickles into vLLM's engine-core process.
    A config without a talker (vLLM probes the callable with a bare config) passes through."""
    talker = getattr(config, "talker_config", None)
    if talker is None:
        return config
    talker.architectures = [TALKER_ARCH]
    # What the talker reads of the rest of the checkpoint: the thinker's vocabulary (its trailing
    # text arrives as thinker ids) and the tts marker ids among them.
    talker.thinker_vocab_size = config.thinker_config.text_config.vocab_size
    for name in ("tts_bos_token_id", "tts_eos_token_id", "tts_pad_token_id"):
        setattr(talker, name, getattr(config, name))
    return talker
