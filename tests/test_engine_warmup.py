"""The warm-up lengths and batches (stages/engine_warmup.py): which step shapes a stage's engine
runs before it is ready, as pure functions of its limits."""

from __future__ import annotations

from vllm_omni_plugin.stages.engine_warmup import (
    MOE_CONFIG_KEYS,
    sampler_settings,
    text_prompt,
    warmup_batches,
    warmup_lengths,
)


def test_every_moe_config_key_is_met_at_both_parities_within_the_step_budget():
    lengths = warmup_lengths(max_step_tokens=2048, max_prompt=30_000)
    assert lengths == sorted(set(lengths)) and lengths[-1] == 2048
    for key in MOE_CONFIG_KEYS:
        if key + 1 <= 2048:
            assert key in lengths or key < 2, key
            assert key + 1 in lengths, key
    assert 3072 not in lengths and 4097 not in lengths


def test_the_model_length_bounds_the_lengths_when_it_is_below_the_budget():
    lengths = warmup_lengths(max_step_tokens=8192, max_prompt=300)
    assert lengths[-1] == 300
    assert 257 in lengths and 512 not in lengths


def test_batches_stop_at_the_engine_s_sequence_limit():
    assert warmup_batches(4) == [2, 3]
    assert warmup_batches(64)[-1] == 32


def test_stage_sampling_overrides_the_checkpoint_s_and_only_sampler_keys_pass():
    got = sampler_settings(
        {"temperature": 0.7, "top_k": 20, "max_tokens": 99},
        {"temperature": 0.9, "seed": 3, "top_p": 0.8},
    )
    assert got == {"temperature": 0.9, "top_k": 20, "top_p": 0.8}


def test_prompts_differ_per_length_and_stay_in_the_ordinary_id_range():
    a, b = (
        text_prompt(33, 151_936)["prompt_token_ids"],
        text_prompt(34, 151_936)["prompt_token_ids"],
    )
    assert len(a) == 33 and len(b) == 34 and a != b[:33]
    assert all(1_000 <= t < 100_000 for t in a + b)
    tiny = text_prompt(20, 500)["prompt_token_ids"]
    assert all(250 <= t < 500 for t in tiny)
