"""Qwen-Image family steps copy nothing between host and device (on an H200 the
batch-8 shape's CUDA graph capture failed with "Cannot copy between CPU and CUDA tensors during
CUDA graph capture", and that shape ran uncaptured).

Two causes, both in diffusers' forward: with an `encoder_hidden_states_mask` (prompts of
different lengths share a forward), `torch.as_tensor(text_seq_len, device=...)`; with
`zero_cond_t` (Qwen-Image-Edit-2511), `modulate_index = torch.tensor(<list>, device=...)`. Each
is a host-to-device copy in every call. A CPU has no device to copy to, so the step runs here
on the meta device (shapes without data: a copy from host memory onto it is still a call that
puts host data on a non-CPU device) under a guard that records every such call and every read
back; the inputs are the ones the adapters build for a real batched step of the tiny models
(Qwen-Image: two prompts of different lengths; Qwen-Image-Edit-Plus: two edits with two
source images each, prompts of different lengths, one with CFG, run by the 2509 transformer
and by the same weights under 2511's zero_cond_t). As StepGraphs does before a capture, one
warm call runs first (lazy caches: RoPE tables moved to the device once). The same forward
without the fix is the control: the guard sees its copies. The outputs equal diffusers' own
forward bit for bit (CPU, fp32: `torch.equal`)."""

from __future__ import annotations

import pytest
import torch
from family_helpers import noise_image
from host_copies import copies_in_warm_call, record_steps, to_meta

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.acceleration import accelerate_transformer
from vllm_omni_plugin.diffusion.adapters.loader import load_pipeline
from vllm_omni_plugin.diffusion.adapters.qwen_image_edit_plus import QwenImageEditPlusAdapter
from vllm_omni_plugin.diffusion.qwen_image_sync_free import SyncFreeQwen
from vllm_omni_plugin.testing.tiny_qwen_image_edit_plus import build_2511

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: per-op overhead
SIZE = 64


def record_step(engine, requests) -> dict:
    """The transformer's keyword arguments in the first (batched, padded) step of `requests`."""
    seen = record_steps(engine, requests)
    assert len(seen) == 2  # one forward per step for all requests (2 steps)
    kwargs = seen[0][1]
    assert kwargs["hidden_states"].shape[0] >= 2
    assert kwargs["encoder_hidden_states_mask"] is not None  # padded: the mask path
    # The engine also passes the rows' text lengths (per-row attention, qwen_image_rows.py,
    # tested in test_qwen_image_rows.py); without them the forward takes diffusers' masked
    # attention, whose host copies these tests are about.
    assert kwargs["attention_kwargs"].pop("text_lengths") is not None
    return kwargs


@pytest.fixture(scope="module")
def engine(tiny_models):
    return DiffusionEngine(
        DiffusionEngineConfig(model=str(tiny_models("qwen-image")), max_batch_size=2)
    )


@pytest.fixture(scope="module")
def step_inputs(engine):
    """One batched step of two prompts of different lengths."""
    return record_step(
        engine,
        [
            GenerationRequest("short", "a cat", height=SIZE, width=SIZE, num_inference_steps=2, seed=1),
            GenerationRequest(
                "long", "a red cube on a table by the window at dusk", height=SIZE,
                width=SIZE, num_inference_steps=2, seed=2,
            ),
        ],
    )  # fmt: skip


class SmallAreaAdapter(QwenImageEditPlusAdapter):
    """Both of diffusers' image areas at 64x64 pixels, for CPU time (as in
    test_qwen_image_edit_plus.py)."""

    condition_pixels = SIZE * SIZE
    vae_pixels = SIZE * SIZE


@pytest.fixture(scope="module")
def edit_engine(tmp_path_factory):
    """An engine on the tiny Qwen-Image-Edit-2511 checkpoint (zero_cond_t)."""
    model_dir = build_2511(tmp_path_factory.mktemp("qwen-image-edit-2511"), seed=0)
    cpu = torch.device("cpu")
    pipe = load_pipeline(model_dir, torch.float32, cpu, skip=SmallAreaAdapter.skip_components)
    adapter = SmallAreaAdapter(pipe, cpu, torch.float32, {})
    engine = DiffusionEngine(DiffusionEngineConfig(model=str(model_dir), max_batch_size=4), adapter)
    assert engine.adapter.pipe.transformer.zero_cond_t
    return engine


@pytest.fixture(scope="module")
def edit_inputs(edit_engine):
    """One batched edit step: two requests with two source images each, prompts of different
    lengths, both with CFG (the engine batches requests of the same CFG use): 4 rows."""
    images = [noise_image(0), noise_image(1, (48, 64))]
    requests = [
        GenerationRequest(
            rid, prompt, negative_prompt=negative, height=SIZE, width=SIZE,
            num_inference_steps=2, seed=seed, input_images=images,
        )
        for rid, prompt, negative, seed in (
            ("red", "make it red", "dark", 1),
            ("cat", "turn the cube on the table into a sleeping cat", "blurry", 2),
        )
    ]  # fmt: skip
    kwargs = record_step(edit_engine, requests)
    assert kwargs["hidden_states"].shape[0] == 4
    assert len(kwargs["img_shapes"][0]) == 3  # the output frame, then the two source images
    return kwargs


def edit_transformer(edit_engine, zero_cond_t: bool, device: str = "cpu"):
    """The 2511 transformer's weights (on `device`) under 2511's config, or 2509's
    (zero_cond_t off), as diffusers builds them."""
    from diffusers import QwenImageTransformer2DModel

    config = {**edit_engine.adapter.pipe.transformer.config, "zero_cond_t": zero_cond_t}
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device(device):
        model = QwenImageTransformer2DModel.from_config(config)
    if device != "meta":
        model.load_state_dict(edit_engine.adapter.pipe.transformer.state_dict())
    return model.eval()


def test_the_engine_runs_qwen_image_through_the_sync_free_call(engine, step_inputs):
    assert isinstance(engine.adapter.transformer, SyncFreeQwen)
    tr = engine.adapter.pipe.transformer
    with torch.no_grad():
        ours = engine.adapter.transformer(**step_inputs)[0]
        theirs = tr(**step_inputs)[0]  # diffusers' forward, its own mask path
        unmasked = tr(**{**step_inputs, "encoder_hidden_states_mask": None})[0]
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, unmasked)  # the mask matters: the comparison is not vacuous


def test_edit_steps_equal_diffusers_with_and_without_zero_cond_t(edit_engine, edit_inputs):
    """2511 (zero_cond_t) and 2509 (the same weights without it): the sync-free call equals
    diffusers' forward bit for bit; zero_cond_t changes the output (not vacuous)."""
    assert isinstance(edit_engine.adapter.transformer, SyncFreeQwen)
    cpu = torch.device("cpu")
    with torch.no_grad():
        ours_2511 = edit_engine.adapter.transformer(**edit_inputs)[0]
        theirs_2511 = edit_engine.adapter.pipe.transformer(**edit_inputs)[0]
        plain = edit_transformer(edit_engine, zero_cond_t=False)
        theirs_2509 = plain(**edit_inputs)[0]
        ours_2509 = accelerate_transformer(plain, cpu)(**edit_inputs)[0]
    assert edit_engine.adapter.pipe.transformer.zero_cond_t  # restored after the call
    assert torch.equal(ours_2511, theirs_2511)
    assert torch.equal(ours_2509, theirs_2509)
    assert not torch.equal(ours_2511, ours_2509)


def meta_step(model, kwargs) -> tuple[list[str], list[str], torch.Size]:
    """What the guard sees in a warm call of the engine's step and of diffusers' forward, on
    the meta device; and the step's output shape."""
    # What the engine calls, built for the device (no CUDA graphs off CUDA: the wrapper alone).
    step = accelerate_transformer(model, torch.device("meta"))
    assert isinstance(step, SyncFreeQwen)
    inputs = to_meta(kwargs)
    fixed, out = copies_in_warm_call(step, inputs)
    plain, _ = copies_in_warm_call(model, inputs)  # diffusers' forward: the control
    return fixed, plain, out[0].shape


def test_a_padded_batch_step_copies_nothing_between_host_and_device(engine, step_inputs):
    from diffusers import QwenImageTransformer2DModel

    config = engine.adapter.pipe.transformer.config
    with torch.device("meta"):
        on_device = QwenImageTransformer2DModel.from_config(config)
    fixed, plain, shape = meta_step(on_device, step_inputs)
    assert shape == step_inputs["hidden_states"].shape
    assert fixed == []
    assert plain == ["as_tensor"]


@pytest.mark.parametrize(
    ("zero_cond_t", "control"),
    [(False, ["as_tensor"]), (True, ["tensor", "as_tensor"])],
    ids=["2509", "2511-zero_cond_t"],
)
def test_an_edit_step_copies_nothing_between_host_and_device(
    edit_engine, edit_inputs, zero_cond_t, control
):
    model = edit_transformer(edit_engine, zero_cond_t, device="meta")
    fixed, plain, shape = meta_step(model, edit_inputs)
    assert shape == edit_inputs["hidden_states"].shape
    assert fixed == []
    assert plain == control  # 2511: its modulate_index, then the text length
    assert model.zero_cond_t == zero_cond_t
