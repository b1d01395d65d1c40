"""The talker as a vLLM model (models/qwen3_omni/talker.py), run by vLLM's own engine on the CPU
against transformers' talker on the tiny checkpoint's weights."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_plugin.families.qwen3_omni import talker_hf_config
from vllm_omni_plugin.testing.qwen3_omni_reference import chat_input_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["Say hello.", "What is two plus two?"]
FIRST_TOKEN = 300  # the thinker's first generated id, any text id


@pytest.fixture(scope="module")
def hf_talker(omni_dir):
    """(config, transformers' talker, conditioner) from the checkpoint, float32."""
    from vllm_omni_plugin.talker.prompt import TalkerConditioner
    from vllm_omni_plugin.talker.runner import load_talker

    config, talker, embed = load_talker(omni_dir)
    return config, talker, TalkerConditioner(config, embed, talker)


@pytest.fixture(scope="module")
def llm(omni_dir):
    from vllm import LLM

    engine = LLM(
        model=str(omni_dir),
        hf_overrides=talker_hf_config,
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


def _prefill(hf_talker, omni_dir, prompt: str) -> torch.Tensor:
    config, _, conditioner = hf_talker
    ids = chat_input_ids(omni_dir, prompt)[0].tolist()
    speaker = config.talker_config.speaker_id["ethan"]
    return conditioner.prefill(ids, FIRST_TOKEN, speaker)


@torch.no_grad()
def _transformers_code0(hf_talker, prefill: torch.Tensor, steps: int) -> list[int]:
    """transformers' talker decoder + codec head, greedy with the codec specials suppressed,
    each step's input the codec embedding of the last code (the decoder alone, no frame)."""
    config, talker, _ = hf_talker
    from vllm_omni_plugin.models.qwen3_omni.talker import suppressed_codec_ids

    tcfg = config.talker_config
    suppressed = suppressed_codec_ids(tcfg.text_config.vocab_size, tcfg.codec_eos_token_id)
    x, codes = prefill, []
    for _ in range(steps):
        positions = torch.arange(x.shape[0])[None].expand(3, 1, -1)
        out = talker.model(inputs_embeds=x[None], position_ids=positions, use_cache=False)
        logits = talker.codec_head(out.last_hidden_state[0, -1])
        code = int(logits.masked_fill(suppressed, float("-inf")).argmax())
        codes.append(code)
        x = torch.cat([x, talker.get_input_embeddings()(torch.tensor([code]))])
    return codes


def test_vllm_talker_code0_equals_transformers(llm, hf_talker, omni_dir):
    """vLLM's engine (paged attention, fused MoE, its sampler at temperature 0) on two prompts
    in one batch, prefill conditioning as prompt_embeds: the greedy first-group codes equal
    transformers' talker on the same weights, 8 steps each (EOS ignored)."""
    from vllm import SamplingParams

    steps = 8
    prefills = [_prefill(hf_talker, omni_dir, p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_embeds": p} for p in prefills], params, use_tqdm=False)
    for prefill, out in zip(prefills, outs, strict=True):
        assert list(out.outputs[0].token_ids) == _transformers_code0(hf_talker, prefill, steps)
