"""The talker's prefill conditioning (models/qwen3_omni/prompt.py) as the talker stage loads it:
the few tensors it reads against transformers' whole model, and the prompts it refuses."""

from __future__ import annotations

import re

import pytest
import torch

from vllm_omni_plugin.models.qwen3_omni.prompt import TalkerConditioner, load_conditioner
from vllm_omni_plugin.pipelines.qwen3_omni import TALKER_HEAD_POSITIONS
from vllm_omni_plugin.testing.qwen3_omni_reference import chat_input_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: per-op overhead


@pytest.fixture(scope="module")
def conditioner(omni_dir):
    return load_conditioner(omni_dir)


def test_loaded_conditioning_equals_transformers_whole_model(conditioner, omni_model, omni_dir):
    """load_conditioner reads the thinker's embedding, the talker's projections and its codec
    embedding only; its prefill and trailing text equal those built on transformers' loaded
    model, and the prefill is as long as `prefill_length` says, within the served limit's
    head allowance (pipelines/qwen3_omni.py)."""
    whole = TalkerConditioner(
        omni_model.config, omni_model.thinker.get_input_embeddings(), omni_model.talker
    )
    speaker = omni_model.config.talker_config.speaker_id["ethan"]
    ids = chat_input_ids(omni_dir, "What is two plus two?")[0].tolist()
    generated = [11, 12, 13, 14]
    got = conditioner.prefill(ids, generated[0], speaker)
    want = whole.prefill(ids, generated[0], speaker)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(
        conditioner.trailing(generated), whole.trailing(generated), atol=0, rtol=0
    )
    assert conditioner.trailing(generated).shape[0] == len(generated) - 1
    assert got.shape[0] == conditioner.prefill_length(ids) <= len(ids) + TALKER_HEAD_POSITIONS


def test_prompts_the_talker_cannot_speak_for_are_refused(conditioner, omni_dir):
    """check_prompt (the talker stage's check before a request reaches its engine): no assistant
    turn, an assistant head cut short, media in a user turn without the thinker's hidden
    states."""
    ids = chat_input_ids(omni_dir, "Say hello.")[0].tolist()
    conditioner.check_prompt(ids, has_hidden=False)
    with pytest.raises(ValueError, match=re.escape("no '<|im_start|>assistant' turn")):
        conditioner.check_prompt(ids[:-3], has_hidden=False)
    with pytest.raises(ValueError, match="must open with"):
        conditioner.check_prompt(ids[:-1], has_hidden=False)
    audio = conditioner.config.thinker_config.audio_token_id
    with_audio = ids[:3] + [audio] + ids[3:]
    with pytest.raises(ValueError, match="hidden states are required"):
        conditioner.check_prompt(with_audio, has_hidden=False)
    conditioner.check_prompt(with_audio, has_hidden=True)
