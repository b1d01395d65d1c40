"""GLM-Image t2i helpers and the position scheme against transformers and diffusers (no engine)."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_plugin.families.glm_image.positions import (
    GridPositionCodec,
    T2ILayout,
    reference_positions,
)
from vllm_omni_plugin.families.glm_image.processing import (
    GRID_EXTRA_ARG,
    build_t2i_prompt,
    num_image_tokens,
    parse_t2i_layout,
    t2i_sampling_overrides,
    target_grids,
    tokens_to_prior_token_ids,
)

PROMPT = "a red cat"  # the prompt tests/ar/conftest.py uses for references
SIZES = [(64, 64), (64, 96), (96, 32), (32, 128), (1024, 1024), (2048, 1152)]


def _processor_inputs(processor, height, width):
    # The exact call diffusers' GlmImagePipeline.generate_prior_tokens makes.
    return processor.apply_chat_template(
        [[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]],
        tokenize=True,
        padding=False,
        target_h=height,
        target_w=width,
        return_dict=True,
        return_tensors="pt",
    )


def _layout(processor, ids):
    tok = processor.tokenizer
    return parse_t2i_layout(
        ids,
        grid_bos_id=tok.convert_tokens_to_ids(tok.grid_bos_token),
        grid_eos_id=tok.convert_tokens_to_ids(tok.grid_eos_token),
        image_start_id=tok.bos_token_id,
        decode=tok.decode,
    )


@pytest.mark.parametrize("height,width", SIZES)
def test_prompt_and_grids_match_the_processor(hf_ar, glm_tiny, height, width):
    _, processor = hf_ar
    inputs = _processor_inputs(processor, height, width)
    ids = build_t2i_prompt(glm_tiny.processor, PROMPT, height, width)
    assert ids == inputs["input_ids"][0].tolist()
    assert ids[-1] == processor.tokenizer.bos_token_id  # image start: generation begins here
    large, preview = target_grids(height, width)
    assert inputs["image_grid_thw"].tolist() == [[1, *large], [1, *preview]]
    layout = _layout(processor, ids)
    assert layout == T2ILayout(prompt_len=len(ids), grids=(preview, large))
    assert layout.num_grid_tokens == num_image_tokens(height, width)
    # vLLM may re-prefill a request with its output appended: same layout.
    assert _layout(processor, ids + [3, 5, 7]) == layout


def test_prompt_rejections(glm_tiny):
    with pytest.raises(ValueError, match="multiples of 32"):
        build_t2i_prompt(glm_tiny.processor, PROMPT, 64, 100)
    with pytest.raises(ValueError, match="image-to-image"):
        build_t2i_prompt(glm_tiny.processor, "edit <|image|> this", 64, 64)
    with pytest.raises(ValueError, match="at most"):
        target_grids(8192, 64)


@pytest.mark.parametrize("height,width", [(64, 64), (64, 96), (96, 32)])
def test_positions_match_transformers_get_rope_index(hf_ar, height, width):
    model, processor = hf_ar
    inputs = _processor_inputs(processor, height, width)
    prefill, _ = model.model.get_rope_index(
        inputs["input_ids"],
        image_grid_thw=inputs["image_grid_thw"],
        images_per_sample=inputs["images_per_sample"],
        attention_mask=inputs["attention_mask"],
    )
    decode = model.model._cached_decode_position_ids[0]  # [3, grid tokens + 1]
    expected = torch.cat([prefill[:, 0], decode], dim=1)

    layout = _layout(processor, inputs["input_ids"][0].tolist())
    n_gen = decode.shape[1]
    assert torch.equal(reference_positions(layout, n_gen), expected)

    # What stock vLLM does: prompt positions from us, then delta + token index per step.
    codec = GridPositionCodec(max_model_len=1024)
    prompt_pos, delta = codec.prompt_positions(layout, layout.prompt_len)
    steps = torch.arange(layout.prompt_len, layout.prompt_len + n_gen) + delta
    vllm_pos = torch.cat([prompt_pos, steps.expand(3, -1)], dim=1)
    assert torch.equal(codec.decode(vllm_pos), expected)
    # A re-prefill that includes generated tokens gets the same positions.
    refill, delta2 = codec.prompt_positions(layout, layout.prompt_len + 10)
    assert delta2 == delta and torch.equal(refill, expected[:, : layout.prompt_len + 10])


def test_codec_mixed_batch_and_slot_reuse():
    codec = GridPositionCodec(max_model_len=512, slots=2)
    a = T2ILayout(prompt_len=20, grids=((16, 16), (2, 2)))
    b = T2ILayout(prompt_len=31, grids=((13, 19), (2, 3)))
    c = T2ILayout(prompt_len=9, grids=((4, 4),))
    text = torch.arange(5).expand(3, -1)
    for layouts in ([a, b], [b, c], [c, a]):  # the third round reuses slots round-robin
        parts, want = [text], [text]
        for x in layouts:
            delta = codec.delta_for(x)
            # vLLM adds delta to an int32 token index: addresses must stay int32.
            assert delta + x.prompt_len + 512 < 2**31
            k = torch.arange(0, x.num_grid_tokens + 3)
            parts.append((x.prompt_len + k + delta).expand(3, -1))
            want.append(reference_positions(x, len(k))[:, x.prompt_len :])
        assert torch.equal(codec.decode(torch.cat(parts, dim=1)), torch.cat(want, dim=1))


@pytest.mark.parametrize("height,width", [(64, 64), (96, 32), (1024, 768)])
def test_prior_tokens_equal_diffusers_helpers(height, width):
    from diffusers import GlmImagePipeline

    large, preview = target_grids(height, width)
    n = num_image_tokens(height, width)
    generated = torch.randint(0, 64, (n + 1,), generator=torch.Generator().manual_seed(n))
    prompt_len = 17
    outputs = torch.cat([torch.full((prompt_len,), 5), generated]).unsqueeze(0)
    d32 = GlmImagePipeline._extract_large_image_tokens(
        outputs, prompt_len, preview[0] * preview[1], large[0] * large[1]
    )
    expected = GlmImagePipeline._upsample_token_ids(d32, *large)
    got = tokens_to_prior_token_ids(generated.tolist(), height, width)
    assert got.dtype == torch.long and torch.equal(got, expected)
    assert got.shape == (1, 4 * large[0] * large[1])
    with pytest.raises(ValueError, match="needs"):
        tokens_to_prior_token_ids(generated[: n - 1].tolist(), height, width)


def test_prior_tokens_equal_generate_prior_tokens(glm_tiny):
    """Our post-processing of the AR's tokens == diffusers' generate_prior_tokens end to end."""
    from diffusers import GlmImagePipeline

    pipe = GlmImagePipeline.from_pretrained(str(glm_tiny.root))
    captured = []
    generate = pipe.vision_language_encoder.generate

    def capture(*args, **kwargs):  # keep the AR's raw output to post-process ourselves
        out = generate(*args, **kwargs)
        captured.append((out, kwargs["input_ids"].shape[1]))
        return out

    pipe.vision_language_encoder.generate = capture
    for height, width in [(64, 64), (64, 96)]:
        prior, _, _ = pipe.generate_prior_tokens(
            PROMPT, height, width, generator=torch.Generator().manual_seed(3)
        )
        out, prompt_len = captured[-1]
        ours = tokens_to_prior_token_ids(out[0, prompt_len:].tolist(), height, width)
        assert torch.equal(ours, prior)


def test_sampling_overrides(glm_tiny):
    from vllm import SamplingParams

    n = num_image_tokens(64, 96)
    for source in (glm_tiny.ar, str(glm_tiny.root)):
        ovr = t2i_sampling_overrides(source, 64, 96)
        assert ovr["max_tokens"] == n + 1 and ovr["min_tokens"] == n
        assert ovr["extra_args"][GRID_EXTRA_ARG] == {
            "num_tokens": n,
            "num_codes": 64,
            "eos_token_id": 65,
        }
        params = SamplingParams(temperature=0.9, seed=1, **ovr)
        assert params.max_tokens == n + 1 and params.stop_token_ids == [65]
