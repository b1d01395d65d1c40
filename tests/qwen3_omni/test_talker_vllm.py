"""The talker as a vLLM model (models/qwen3_omni/talker.py, talker_runner.py), run by vLLM's own
engine on the CPU against transformers' `generate` on the tiny checkpoint."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_plugin.families.qwen3_omni import talker_hf_config
from vllm_omni_plugin.testing.qwen3_omni_reference import chat_input_ids, reference_generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["Say hello.", "What is two plus two?", "Hi"]
# The reference's settings (testing/qwen3_omni_reference.py): greedy, no repetition penalty.
GREEDY = {"temperature": 0.0, "repetition_penalty": 1.0}
MAX_FRAMES = 10


@pytest.fixture(scope="module")
def conditioner(omni_dir):
    """Builds the prefill conditioning as the talker stage does (talker/prompt.py)."""
    from vllm_omni_plugin.talker.prompt import TalkerConditioner
    from vllm_omni_plugin.talker.runner import load_talker

    config, talker, embed = load_talker(omni_dir)
    return TalkerConditioner(config, embed, talker)


@pytest.fixture(scope="module")
def talker_config(omni_dir):
    from transformers import Qwen3OmniMoeConfig

    return talker_hf_config(Qwen3OmniMoeConfig.from_pretrained(omni_dir))


@pytest.fixture(scope="module")
def references(omni_model, omni_dir):
    out = {}
    for p in PROMPTS:
        ids = chat_input_ids(omni_dir, p)
        ref = reference_generate(omni_model, ids, thinker_max_new_tokens=6, max_frames=MAX_FRAMES)
        out[p] = (ids[0].tolist(), ref)
    return out


@pytest.fixture(scope="module")
def llm(omni_dir):
    from vllm import LLM

    from vllm_omni_plugin.models.qwen3_omni.talker_runner import talker_worker_cls

    engine = LLM(
        model=str(omni_dir),
        hf_overrides=talker_hf_config,
        worker_cls=talker_worker_cls(),
        skip_tokenizer_init=True,
        enable_prompt_embeds=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=4,
        enable_prefix_caching=False,
        generation_config="vllm",  # the checkpoint's generation config is the thinker's
        seed=0,
    )
    yield engine
    del engine


def _generate(llm, conditioner, talker_config, requests, **sampling) -> list[torch.Tensor]:
    """requests: [(prompt ids, thinker text ids)] in one batch -> each one's frames [G, n]."""
    from vllm_omni_plugin.models.qwen3_omni.talker_runner import (
        frame_sampling_params,
        frames_from_logprobs,
    )

    speaker = talker_config.speaker_id["ethan"]
    prompts = [{"prompt_embeds": conditioner.prefill(i, t[0], speaker)} for i, t in requests]
    params = [frame_sampling_params(talker_config, t, MAX_FRAMES, **sampling) for _, t in requests]
    outs = llm.generate(prompts, params, use_tqdm=False)
    text = talker_config.text_config
    frames = []
    for out in outs:
        f = frames_from_logprobs(
            out.outputs[0].logprobs,
            text.vocab_size,
            talker_config.code_predictor_config.vocab_size,
            talker_config.num_code_groups,
        )
        assert f.shape[1] == len(out.outputs[0].token_ids)
        if f.shape[1] and int(f[0, -1]) == talker_config.codec_eos_token_id:
            f = f[:, :-1]  # the codec EOS ends the speech: no frame
        frames.append(f)
    return frames


def test_vllm_talker_frames_equal_transformers(llm, conditioner, talker_config, references):
    """vLLM's engine (paged attention, fused MoE, its sampler at temperature 0), the code
    predictor inside its step: every code group of every frame equals transformers' greedy
    `generate` on the same weights, exactly (argmax margins far above float32 noise)."""
    ids, ref = references[PROMPTS[0]]
    (frames,) = _generate(llm, conditioner, talker_config, [(ids, ref.text_ids)], **GREEDY)
    assert frames.shape == ref.codes.shape and ref.codes.shape[1] > 1
    assert torch.equal(frames, ref.codes)


def test_vllm_talker_batched_equals_alone(llm, conditioner, talker_config, references):
    """Three requests of different prompt and text lengths in one engine step each: each one's
    frames equal transformers' for it alone."""
    requests = [(ids, ref.text_ids) for ids, ref in references.values()]
    got = _generate(llm, conditioner, talker_config, requests, **GREEDY)
    for frames, (_, ref) in zip(got, references.values(), strict=True):
        assert torch.equal(frames, ref.codes)


def test_vllm_talker_seeded_sampling(llm, conditioner, talker_config, references):
    """The checkpoint's sampling (talker top-k 50, temperature 0.9, repetition penalty; code
    predictor top-k 50, top-p 0.8), here with repetition penalty 2.0 so that anything the
    penalty miscounts shows: the same seed gives the same frames, also after another request
    wrote its codes into the engine's batch row; another seed gives other frames."""
    long_ids, long_ref = references[PROMPTS[1]]
    short_ids, short_ref = references[PROMPTS[2]]
    request = [(long_ids, long_ref.text_ids)]

    def run(seed: int, req=request) -> torch.Tensor:
        (frames,) = _generate(
            llm, conditioner, talker_config, req, seed=seed, repetition_penalty=2.0
        )
        return frames

    first = run(7)
    run(1, [(short_ids, short_ref.text_ids)])  # a shorter prompt in the same batch row
    assert first.shape[1] > 1
    assert torch.equal(run(7), first)
    assert not torch.equal(run(8), first)
