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
    """Builds the prefill conditioning as the talker stage does (models/qwen3_omni/prompt.py)."""
    from vllm_omni_plugin.models.qwen3_omni.prompt import load_conditioner

    return load_conditioner(omni_dir)


@pytest.fixture(scope="module")
def talker_config(omni_dir):
    from transformers import Qwen3OmniMoeConfig

    return talker_hf_config(Qwen3OmniMoeConfig.from_pretrained(omni_dir))


# A frame whose reference argmax (talker head or any code-predictor head) wins by less than
# this is a near-tie on the random tiny weights: float32 summation order (batch size, threads)
# may flip it, so the exact comparisons stop before the first such frame.
NEAR_TIE = 1e-3


def _margin(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


@pytest.fixture(scope="module")
def references(omni_model, omni_dir):
    """prompt -> (prompt ids, transformers' greedy output, number of leading frames without a
    near-tie)."""
    talker = omni_model.talker
    tcfg = omni_model.config.talker_config
    from vllm_omni_plugin.models.qwen3_omni.talker import suppressed_codec_ids

    suppressed = suppressed_codec_ids(tcfg.text_config.vocab_size, tcfg.codec_eos_token_id)
    out = {}
    for p in PROMPTS:
        heads: list[list[float]] = [[] for _ in range(tcfg.num_code_groups)]

        def record(group, heads=heads):
            def hook(_module, _args, logits):
                last = logits[0, -1]
                if group == 0:
                    last = last.masked_fill(suppressed, float("-inf"))
                heads[group].append(_margin(last))

            return hook

        hooks = [talker.codec_head.register_forward_hook(record(0))]
        hooks += [
            head.register_forward_hook(record(j + 1))
            for j, head in enumerate(talker.code_predictor.lm_head)
        ]
        try:
            ids = chat_input_ids(omni_dir, p)
            ref = reference_generate(
                omni_model, ids, thinker_max_new_tokens=6, max_frames=MAX_FRAMES
            )
        finally:
            for h in hooks:
                h.remove()
        margins = [min(h[f] for h in heads) for f in range(ref.num_frames)]
        clear = next((f for f, m in enumerate(margins) if m < NEAR_TIE), ref.num_frames)
        out[p] = (ids[0].tolist(), ref, clear)
    return out


@pytest.fixture(scope="module")
def llm(omni_dir):
    from vllm import LLM

    from vllm_omni_plugin.models.qwen3_omni.talker_runner import talker_engine_args

    engine = LLM(
        model=str(omni_dir),
        **talker_engine_args(),
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=4,
        # Prefills of 16-34 positions: all but the shortest prompt prefill in chunks, in steps
        # shared with other requests' chunks and decode steps. (The shortest one prefills in
        # one step: vLLM's CPU runner cannot rewind a seeded CPU generator after a chunk.)
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
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
    `generate` on the same weights, exactly, up to the first near-tie (NEAR_TIE)."""
    ids, ref, clear = references[PROMPTS[0]]
    (frames,) = _generate(llm, conditioner, talker_config, [(ids, ref.text_ids)], **GREEDY)
    assert clear > 1
    if clear == ref.num_frames:
        assert frames.shape == ref.codes.shape
    assert torch.equal(frames[:, :clear], ref.codes[:, :clear])


def test_vllm_talker_batched_equals_alone(llm, conditioner, talker_config, references):
    """Three requests of different prompt and text lengths in one engine step each: each one's
    frames equal transformers' for it alone, up to its first near-tie (NEAR_TIE)."""
    requests = [(ids, ref.text_ids) for ids, ref, _ in references.values()]
    got = _generate(llm, conditioner, talker_config, requests, **GREEDY)
    for frames, (prompt, (_, ref, clear)) in zip(got, references.items(), strict=True):
        assert clear > 1, prompt
        assert torch.equal(frames[:, :clear], ref.codes[:, :clear]), prompt


def test_vllm_talker_seeded_sampling(llm, conditioner, talker_config, references):
    """The checkpoint's sampling (talker top-k 50, temperature 0.9, repetition penalty 1.05;
    code predictor top-k 50, top-p 0.8): the same seed gives the same frames, another seed
    other frames."""
    ids, ref, _ = references[PROMPTS[2]]

    def run(seed: int) -> torch.Tensor:
        (frames,) = _generate(llm, conditioner, talker_config, [(ids, ref.text_ids)], seed=seed)
        return frames

    first = run(7)
    assert first.shape[1] > 1
    assert torch.equal(run(7), first)
    assert not torch.equal(run(8), first)


def test_vllm_talker_penalty_ignores_earlier_requests(llm, conditioner, talker_config, references):
    """Greedy with repetition penalty 2.0 (so that a miscounted id changes the frames): a
    request gives the same frames after another request, with a shorter prompt, wrote its
    codes into the engine's batch row (where the first one's prompt positions lie)."""
    long_ids, long_ref, _ = references[PROMPTS[1]]
    short_ids, short_ref, _ = references[PROMPTS[2]]
    settings = {"temperature": 0.0, "repetition_penalty": 2.0}

    def run(ids, text) -> torch.Tensor:
        (frames,) = _generate(llm, conditioner, talker_config, [(ids, text)], **settings)
        return frames

    first = run(long_ids, long_ref.text_ids)
    run(short_ids, short_ref.text_ids)
    assert first.shape[1] > 1
    assert torch.equal(run(long_ids, long_ref.text_ids), first)
