"""The vLLM talker under preemption: a KV cache of 160 positions, which three requests of a
10-28 position prompt and 60 frames each overflow, so vLLM preempts requests and later
recomputes their KV from the prompt and the first codes of the frames they had written. Each of
those positions' inputs needs its frame's other codes and its text entry again
(models/qwen3_omni/talker_runner.py keeps every frame's codes for it): every frame of every
request equals, exactly, what the same request writes alone in the same engine (alone it fits
the cache and is never preempted). Without the recomputed inputs the preempted requests' frames
part from the alone ones at the frame they were preempted in.
"""

from __future__ import annotations

import pytest
import torch
from vllm_engines import shut_down

from vllm_omni_plugin.families.qwen3_omni import talker_hf_config
from vllm_omni_plugin.testing.qwen3_omni_reference import chat_input_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["Say hello.", "What is two plus two?", "Hi"]
FRAMES = 60
BLOCK = 32  # vLLM's CPU attention takes multiples of 32
BLOCKS = 5  # 160 positions (vLLM keeps one more block aside, its null block)


@pytest.fixture(scope="module")
def talker(omni_dir):
    from transformers import Qwen3OmniMoeConfig
    from vllm import LLM

    from vllm_omni_plugin.models.qwen3_omni.prompt import load_conditioner
    from vllm_omni_plugin.models.qwen3_omni.talker_runner import talker_engine_args

    engine = LLM(
        model=str(omni_dir),
        **talker_engine_args(),
        enforce_eager=True,
        dtype="float32",
        max_model_len=BLOCK * BLOCKS,
        max_num_seqs=4,
        block_size=BLOCK,
        num_gpu_blocks_override=BLOCKS + 1,
        disable_log_stats=False,  # vLLM's preemption counter
        seed=0,
    )
    config = talker_hf_config(Qwen3OmniMoeConfig.from_pretrained(omni_dir))
    yield engine, config, load_conditioner(omni_dir)
    shut_down(engine)


def _preemptions() -> float:
    from vllm.v1.metrics.reader import get_metrics_snapshot

    return sum(m.value for m in get_metrics_snapshot() if m.name == "vllm:num_preemptions")


def _frames(talker, requests) -> list[torch.Tensor]:
    """requests: [(prompt ids, thinker text ids)] in one batch -> each one's frames [G, FRAMES]
    (greedy, exactly FRAMES: a random-weight talker may write its codec EOS early)."""
    from vllm_omni_plugin.models.qwen3_omni.talker_runner import (
        frame_sampling_params,
        frames_from_logprobs,
    )

    engine, config, conditioner = talker
    speaker = config.speaker_id["ethan"]
    prompts = [
        {"prompt_embeds": conditioner.prefill(ids, text[0], speaker)} for ids, text in requests
    ]
    params = [
        frame_sampling_params(
            config, text, FRAMES, temperature=0.0, repetition_penalty=1.0, min_tokens=FRAMES
        )
        for _, text in requests
    ]
    outs = engine.generate(prompts, params, use_tqdm=False)
    sizes = (config.text_config.vocab_size, config.code_predictor_config.vocab_size)
    return [
        frames_from_logprobs(out.outputs[0].logprobs, *sizes, config.num_code_groups)
        for out in outs
    ]


def test_preempted_requests_write_the_frames_they_write_alone(talker, omni_dir):
    # Thinker text of 12 ids: the talker reads past its end (tts_eos, then tts_pad) too.
    requests = [(chat_input_ids(omni_dir, p)[0].tolist(), list(range(100, 112))) for p in PROMPTS]
    alone = [_frames(talker, [r])[0] for r in requests]
    before = _preemptions()
    together = _frames(talker, requests)
    assert _preemptions() > before, "the KV cache was meant to force a preemption"
    for prompt, a, b in zip(PROMPTS, alone, together, strict=True):
        assert a.shape == b.shape == (talker[1].num_code_groups, FRAMES), prompt
        assert torch.equal(a, b), (prompt, int((a == b).all(0).sum()))
