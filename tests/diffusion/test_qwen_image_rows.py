"""Qwen-Image's per-row joint attention (diffusion/qwen_image_rows.py): a batch of prompts of
different lengths attends per row over each prompt's unpadded tokens, no mask.

Tolerances (fp32 on the CPU): a batched image's final packed latents equal the same prompt
alone within 1e-5 (max abs; the batched projections round differently from batch-1 ones, the
attention itself is each prompt's own) and diffusers' QwenImagePipeline's within 1e-4, as in the
family's other parity tests. bf16 on a GPU is not bitwise either way: batched and batch-1 GEMMs
tile differently, so there the comparison needs bf16's resolution (about 1e-2 relative).

Every batched test also checks that the per-row path ran (the processors count their calls)
and the masked fallback did not, so a silent fallback cannot pass for it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from family_helpers import (
    latent_keeping_engine,
    reference_pipeline,
    run_keeping_last_latents,
    seeded,
    square_request,
)
from host_copies import copies_in_warm_call, on_meta, record_steps, to_meta

from vllm_omni_plugin.diffusion import qwen_image_rows
from vllm_omni_plugin.diffusion.acceleration import accelerate_transformer, reset_transformer
from vllm_omni_plugin.diffusion.adapters.qwen_image import QwenImageAdapter
from vllm_omni_plugin.diffusion.cuda_graphs import signature
from vllm_omni_plugin.testing.tiny_qwen_image import build_transformer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: per-op overhead
SIZE = 64
STEPS = 2
ALONE_TOLERANCE = 1e-5
DIFFUSERS_TOLERANCE = 1e-4
CPU = torch.device("cpu")

# Three prompts of clearly different token lengths, each with a negative prompt of yet another
# length (true CFG: the uncond rows join the batch with their own lengths).
PROMPTS = [
    ("cat", "a blurry, noisy, low quality picture with bad anatomy and ugly colours"),
    ("a red cube on a wooden table by the window at dusk, and a cat asleep beside it", "dark"),
    ("a photo of a cat", "blurry"),
]


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("qwen-image")


@pytest.fixture(scope="module")
def engine(model_dir):
    return latent_keeping_engine(QwenImageAdapter, model_dir, max_batch_size=8)


def requests(prefix: str) -> list:
    return [
        square_request(f"{prefix}{i}", prompt, SIZE, 10 + i, STEPS, negative_prompt=negative)
        for i, (prompt, negative) in enumerate(PROMPTS)
    ]


def test_batched_mixed_lengths_with_cfg_equal_alone_and_diffusers(engine, model_dir):
    from diffusers import QwenImagePipeline

    tr = engine.adapter.pipe.transformer
    before = qwen_image_rows.counts(tr)
    batch = requests("b")
    seen = record_steps(engine, batch)
    after = qwen_image_rows.counts(tr)
    assert len(seen) == STEPS  # all three shared every forward
    kwargs = seen[0][1]
    lengths = kwargs["attention_kwargs"][qwen_image_rows.TEXT_LENGTHS]
    assert len(lengths) == 6 and len(set(lengths)) == 6  # 3 cond rows + 3 uncond, all different
    assert kwargs["encoder_hidden_states_mask"] is not None  # padded batch
    blocks = len(tr.transformer_blocks)
    assert after["per_row"] - before["per_row"] == blocks * STEPS
    assert after["masked"] == before["masked"]

    pipe = reference_pipeline(QwenImagePipeline, model_dir)
    for r in batch:
        alone = dataclasses.replace(r, request_id=f"alone-{r.request_id}")
        (out,) = engine.generate([alone])
        assert out.error is None
        got = engine.final_latents[r.request_id]
        assert (got - engine.final_latents[alone.request_id]).abs().max() <= ALONE_TOLERANCE
        want, _ = run_keeping_last_latents(
            pipe,
            r.prompt,
            negative_prompt=r.negative_prompt,
            true_cfg_scale=4.0,
            height=SIZE,
            width=SIZE,
            num_inference_steps=STEPS,
            generator=seeded(r.seed),
        )
        assert (got - want).abs().max() <= DIFFUSERS_TOLERANCE, r.request_id
    # The prompts make different pictures: the comparisons are not vacuous.
    a, b = (engine.final_latents[r.request_id] for r in batch[:2])
    assert (a - b).abs().max() > 100 * DIFFUSERS_TOLERANCE


# ---- the processor on the tiny transformer alone -------------------------------------------
LENGTHS = (5, 9, 9, 3)  # rows 1 and 2 share one attention call


def forward_inputs(lengths=LENGTHS, per_row: bool = True, seed: int = 0) -> dict:
    """A padded batch as the adapter builds it: right-padded text, its mask, and (`per_row`)
    the rows' lengths in attention_kwargs."""
    g = torch.Generator().manual_seed(seed)
    rows, padded = len(lengths), max(lengths)
    text = torch.randn(rows, padded, 32, generator=g)
    mask = torch.zeros(rows, padded, dtype=torch.long)
    for i, n in enumerate(lengths):
        text[i, n:] = 0
        mask[i, :n] = 1
    return {
        "hidden_states": torch.randn(rows, 16, 64, generator=g),
        "encoder_hidden_states": text,
        "encoder_hidden_states_mask": mask,
        "timestep": torch.rand(rows, generator=g),
        "img_shapes": [[(1, 4, 4)]] * rows,
        "attention_kwargs": {qwen_image_rows.TEXT_LENGTHS: tuple(lengths)} if per_row else {},
        "return_dict": False,
    }


def alone(tr, kwargs: dict, lengths=LENGTHS) -> torch.Tensor:
    """Each row through the transformer by itself, its text unpadded, no mask."""
    outs = []
    for i, n in enumerate(lengths):
        outs.append(
            tr(
                hidden_states=kwargs["hidden_states"][i : i + 1],
                encoder_hidden_states=kwargs["encoder_hidden_states"][i : i + 1, :n],
                timestep=kwargs["timestep"][i : i + 1],
                img_shapes=kwargs["img_shapes"][:1],
                return_dict=False,
            )[0]
        )
    return torch.cat(outs)


@pytest.fixture
def tiny():
    """The tiny transformer (2 blocks) and diffusers' own copy (no processor change)."""
    tr = build_transformer(0).eval()
    plain = build_transformer(0).eval()
    yield tr, plain
    reset_transformer(tr)


@torch.no_grad()
def test_per_row_step_equals_each_row_alone(tiny):
    tr, plain = tiny
    step = accelerate_transformer(tr, CPU)
    kwargs = forward_inputs()
    out = step(**kwargs)[0]
    assert qwen_image_rows.counts(tr) == {"per_row": 2, "masked": 0}
    assert qwen_image_rows.runs(LENGTHS) == [(0, 1, 5), (1, 3, 9), (3, 4, 3)]
    assert (out - alone(plain, kwargs)).abs().max() <= ALONE_TOLERANCE
    # diffusers' masked batch gives the same images (what the per-row path replaces) ...
    masked = plain(**forward_inputs(per_row=False))[0]
    assert (out - masked).abs().max() <= ALONE_TOLERANCE
    # ... and without the mask the padding is attended to: the check sees the padding.
    unmasked = plain(**{**forward_inputs(per_row=False), "encoder_hidden_states_mask": None})[0]
    assert (out - unmasked).abs().max() > 100 * ALONE_TOLERANCE


@torch.no_grad()
def test_without_lengths_the_call_is_diffusers_own(tiny):
    """Equal lengths (no mask) or no lengths given: diffusers' processor, bit for bit."""
    tr, plain = tiny
    step = accelerate_transformer(tr, CPU)
    masked = forward_inputs(per_row=False)
    assert torch.equal(step(**masked)[0], plain(**masked)[0])
    even = forward_inputs((6, 6, 6), per_row=False)
    even["encoder_hidden_states_mask"] = None
    assert torch.equal(step(**even)[0], plain(**even)[0])
    assert qwen_image_rows.counts(tr) == {"per_row": 0, "masked": 0}
    assert qwen_image_rows.attention_kwargs(tr, [6, 6, 6]) == {}
    assert qwen_image_rows.attention_kwargs(tr, [6, 2]) == {"text_lengths": (6, 2)}
    assert qwen_image_rows.attention_kwargs(plain, [6, 2]) == {}  # not installed: none


@torch.no_grad()
def test_lengths_that_do_not_fit_the_call_take_the_masked_path(tiny):
    """Rows or tokens other than the lengths describe (a step cache's row subset, Ulysses'
    token split): diffusers' masked attention, bit for bit, counted."""
    tr, plain = tiny
    step = accelerate_transformer(tr, CPU)
    kwargs = forward_inputs()
    subset = {**kwargs, "attention_kwargs": {qwen_image_rows.TEXT_LENGTHS: (5, 9, 9)}}
    shorter = {**kwargs, "attention_kwargs": {qwen_image_rows.TEXT_LENGTHS: (5, 8, 8, 3)}}
    want = plain(**forward_inputs(per_row=False))[0]
    for call in (subset, shorter):
        assert torch.equal(step(**call)[0], want)
    assert qwen_image_rows.counts(tr) == {"per_row": 0, "masked": 4}


def test_install_is_undone(tiny):
    tr, _ = tiny
    assert not qwen_image_rows.installed(tr)
    accelerate_transformer(tr, CPU)
    assert qwen_image_rows.installed(tr)
    assert len(qwen_image_rows.processors(tr)) == len(tr.transformer_blocks)
    reset_transformer(tr)
    assert not qwen_image_rows.installed(tr)
    assert all(
        type(p).__name__ == "QwenDoubleStreamAttnProcessor2_0" for p in tr.attn_processors.values()
    )


def test_a_cuda_graph_is_never_replayed_for_other_lengths():
    """The lengths are part of the call's CUDA graph signature (cuda_graphs.signature): a graph
    captured for one batch's lengths does not serve another batch of the same padded shape."""
    a = signature(forward_inputs((5, 9, 9, 3)), CPU)
    b = signature(forward_inputs((9, 5, 9, 3)), CPU)
    assert a is not None and b is not None and a != b
    assert signature(forward_inputs((9, 5, 9, 3), seed=1), CPU) == b


@torch.no_grad()
def test_a_per_row_step_copies_nothing_between_host_and_device():
    """The per-row path adds no host<->device copy or read (the meta device stands in for the
    GPU, as in test_qwen_image_sync_free.py): it can be captured in a CUDA graph."""
    model = on_meta(build_transformer(0))
    step = accelerate_transformer(model, torch.device("meta"))
    seen, out = copies_in_warm_call(step, to_meta(forward_inputs()))
    assert seen == []
    assert out[0].shape == (4, 16, 64)
    assert qwen_image_rows.counts(model)["per_row"] == 4  # warm call + watched call, 2 blocks


@torch.no_grad()
def test_regional_compile_runs_per_row_without_recompiling_for_new_lengths(tiny):
    """Compiled blocks (as served: regional, dynamic shapes) equal the eager per-row step, and a
    batch of other lengths reuses the compiled graphs (the per-row part runs outside them).
    ~45 s: two block-graph compiles on the CPU."""
    from torch._dynamo.utils import counters

    tr, plain = tiny
    qwen_image_rows.install(plain)
    step = accelerate_transformer(tr, CPU, compile=True, regional=True)
    first = forward_inputs()
    assert (step(**first)[0] - plain(**first)[0]).abs().max() <= ALONE_TOLERANCE
    graphs = counters["stats"]["unique_graphs"]
    other = forward_inputs((2, 7, 4, 4), seed=1)
    assert (step(**other)[0] - plain(**other)[0]).abs().max() <= ALONE_TOLERANCE
    assert counters["stats"]["unique_graphs"] == graphs
    assert qwen_image_rows.counts(tr) == {"per_row": 4, "masked": 0}
