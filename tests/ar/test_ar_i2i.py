"""GLM-Image image-to-image in the AR stage: vLLM's multimodal input path against transformers.

The source image goes to vLLM as `multi_modal_data` next to a prompt holding one `<|image|>`
per image; our processor expands it, the model runs the checkpoint's vision tokenizer and
embeds the codes. Reference: transformers' GlmImageForConditionalGeneration.generate on the
processor's own inputs (what diffusers' pipeline feeds it), greedy, fp32: tokens must be equal.
"""

from __future__ import annotations

import gc

import pytest
import torch
from vllm_engines import shut_down

from vllm_omni_plugin.families.glm_image.processing import (
    build_i2i_prompt,
    build_t2i_prompt,
    fit_source_image,
    num_image_tokens,
    source_pixel_bounds,
    source_positions,
    t2i_sampling_overrides,
    tokens_to_prior_token_ids,
)
from vllm_omni_plugin.models.glm_image import LOGITS_PROCESSOR

PROMPT = "make it blue"
T2I_PROMPT = "a red cat"  # tests/ar/conftest.py's reference prompt
SIZES = [(64, 64), (64, 96)]


def source_image(width: int, height: int, seed: int = 0):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(height, width, 3, generator=g) * 255).to(torch.uint8).numpy()
    return Image.fromarray(arr, "RGB")


@pytest.fixture(scope="module")
def fitted(hf_ar):
    _, processor = hf_ar
    # 100x70 upload: fitted to multiples of 32 inside the tiny processor's bounds.
    return fit_source_image(source_image(100, 70), *source_pixel_bounds(processor))


def _hf_inputs(processor, image, height, width):
    return processor.apply_chat_template(
        [
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": image},
                        {"type": "text", "text": PROMPT},
                    ],
                }
            ]
        ],
        tokenize=True,
        target_h=height,
        target_w=width,
        return_dict=True,
        return_tensors="pt",
    )


@pytest.fixture(scope="module")
def hf_i2i(hf_ar, fitted):
    model, processor = hf_ar
    out = {}
    for h, w in SIZES:
        inputs = _hf_inputs(processor, fitted, h, w)
        with torch.no_grad():
            gen = model.generate(
                **inputs, max_new_tokens=num_image_tokens(h, w, preview=False) + 1, do_sample=False
            )
        out[(h, w)] = gen[0, inputs["input_ids"].shape[1] :].tolist()
    return out


def test_fit_source_image_sizes(hf_ar):
    _, processor = hf_ar
    bounds = source_pixel_bounds(processor)
    assert fit_source_image(source_image(100, 70), *bounds).size == (96, 64)
    assert fit_source_image(source_image(64, 64), *bounds).size == (64, 64)  # unchanged
    assert fit_source_image(source_image(1000, 500), *bounds).size == (256, 128)
    with pytest.raises(ValueError, match="aspect"):
        fit_source_image(source_image(200, 40), *bounds)


def test_prompt_and_positions_match_transformers(hf_ar, glm_tiny, fitted):
    """One placeholder per image (vLLM expands it); expanded, the ids are the processor's, and
    `source_positions` equals transformers' get_rope_index on them."""
    model, processor = hf_ar
    h, w = SIZES[1]
    inputs = _hf_inputs(processor, fitted, h, w)
    ref_ids = inputs["input_ids"][0].tolist()
    ours = build_i2i_prompt(glm_tiny.processor, PROMPT, [fitted], h, w)
    token = processor.image_token_id
    assert ours.count(token) == 1
    rows, cols = fitted.size[1] // 32, fitted.size[0] // 32
    at = ours.index(token)
    assert ours[:at] + [token] * (rows * cols) + ours[at + 1 :] == ref_ids
    ref_pos, _ = model.model.get_rope_index(
        inputs["input_ids"],
        image_grid_thw=inputs["image_grid_thw"],
        images_per_sample=inputs["images_per_sample"],
    )
    pos, start = source_positions(len(ref_ids), [(at, rows, cols)])
    assert torch.equal(pos, ref_pos[:, 0, :])
    # The decode grid starts where transformers' cached decode positions start.
    assert start == int(model.model._cached_decode_position_ids[0, 0, 0])


@pytest.fixture(scope="module")
def llm(glm_tiny):
    from vllm import LLM

    engine = LLM(
        model=glm_tiny.ar,
        tokenizer=glm_tiny.processor,
        logits_processors=[LOGITS_PROCESSOR],
        scheduler_cls="vllm_omni_plugin.core.sched.OmniARAsyncScheduler",
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=8,
    )
    yield engine
    shut_down(engine)
    del engine
    gc.collect()


def _i2i(glm_tiny, image, h, w):
    from vllm import SamplingParams

    prompt = {
        "prompt_token_ids": build_i2i_prompt(glm_tiny.processor, PROMPT, [image], h, w),
        "multi_modal_data": {"image": [image]},
    }
    params = SamplingParams(
        temperature=0.0, **t2i_sampling_overrides(glm_tiny.ar, h, w, preview=False)
    )
    return prompt, params


def _t2i(glm_tiny, h, w):
    from vllm import SamplingParams

    prompt = {"prompt_token_ids": build_t2i_prompt(glm_tiny.processor, T2I_PROMPT, h, w)}
    return prompt, SamplingParams(temperature=0.0, **t2i_sampling_overrides(glm_tiny.ar, h, w))


@pytest.mark.slow
def test_vllm_i2i_equals_transformers_alone_and_batched(llm, glm_tiny, fitted, hf_i2i, hf_greedy):
    """Greedy, fp32: vLLM's tokens equal transformers' exactly, for an image-to-image request
    alone, and in one batch with another size's edit and two text-to-image requests."""
    h, w = SIZES[0]
    (alone,) = llm.generate(*map(lambda x: [x], _i2i(glm_tiny, fitted, h, w)), use_tqdm=False)
    tokens = list(alone.outputs[0].token_ids)
    assert len(tokens) == num_image_tokens(h, w, preview=False) + 1
    assert tokens == hf_i2i[(h, w)]
    prior = tokens_to_prior_token_ids(tokens, h, w, preview=False)
    assert prior.shape == (1, 4 * (h // 32) * (w // 32))

    reqs = [
        _i2i(glm_tiny, fitted, *SIZES[0]),
        _t2i(glm_tiny, *SIZES[0]),
        _i2i(glm_tiny, fitted, *SIZES[1]),
        _t2i(glm_tiny, *SIZES[1]),
    ]
    outs = llm.generate([r[0] for r in reqs], [r[1] for r in reqs], use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got[0] == hf_i2i[SIZES[0]]
    assert got[2] == hf_i2i[SIZES[1]]
    assert got[1] == hf_greedy(*SIZES[0])
    assert got[3] == hf_greedy(*SIZES[1])


@pytest.mark.slow
def test_the_source_image_conditions_the_tokens(llm, glm_tiny, fitted):
    """Another source image (same prompt, size) changes the greedy tokens: the image really
    reaches the model."""
    other = fit_source_image(source_image(100, 70, seed=1), 32 * 32, 256 * 256)
    a = llm.generate([_i2i(glm_tiny, fitted, 64, 64)[0]], [_i2i(glm_tiny, fitted, 64, 64)[1]])
    b = llm.generate([_i2i(glm_tiny, other, 64, 64)[0]], [_i2i(glm_tiny, other, 64, 64)[1]])
    assert list(a[0].outputs[0].token_ids) != list(b[0].outputs[0].token_ids)


# vLLM 0.26 (the GPU machine's) processes images alone through a different path than the CPU
# venv's 0.32 (`call_hf_processor_mm_only`, up to 0.28): our processor must serve both.
PROBE_026 = """
import json, sys
from PIL import Image
import vllm
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.config import ModelConfig
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.processing import ProcessorInputs
from vllm.multimodal.processing.context import TimingContext
root = sys.argv[1]
cfg = ModelConfig(model=root + "/vision_language_encoder", tokenizer=root + "/processor")
proc = MULTIMODAL_REGISTRY.create_processor(cfg)
dummy = MULTIMODAL_REGISTRY.get_dummy_mm_inputs(cfg, {"image": 1})
items = proc.info.parse_mm_data({"image": [Image.new("RGB", (768, 512), (40, 90, 200))]})
ids = proc.info.ctx.tokenizer.encode("<|image|>make it blue", add_special_tokens=False)
res = proc.apply(ProcessorInputs(prompt=ids, mm_data_items=items), TimingContext())
ranges = lambda out: [[r.offset, r.length] for r in out["mm_placeholders"]["image"]]
print(json.dumps({"vllm": vllm.__version__, "processor": type(proc).__name__,
                  "dummy": ranges(dummy), "image": ranges(res)}))
"""


@pytest.mark.slow
def test_vllm_026_processes_real_images(glm_tiny):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    source = Path(sys.prefix) / "vllm-seam-sources" / "0.26.0"
    assert source.is_dir(), f"{source} missing: run `make setup`"
    env = {**os.environ, "PYTHONPATH": str(source), "VLLM_TARGET_DEVICE": "cpu"}
    root = str(Path(glm_tiny.ar).parent)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE_026, root],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["vllm"] == "0.26.0" and out["processor"] == "GlmImageMultiModalProcessor"
    # 256 px dummy -> 8x8; a 768x512 upload -> 8x5 (the tiny processor's 256 px bound, halved).
    assert out == {**out, "dummy": [[0, 64]], "image": [[0, 40]]}
