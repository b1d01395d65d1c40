"""The transformer forwards the engine captures in CUDA graphs (diffusion/cuda_graphs.py) copy
nothing between host and device at batch > 1: FLUX.1, FLUX.2 klein, Z-Image-Turbo, GLM-Image
(through its sync-free wrapper) and Wan2.2.

A copy from pageable host memory inside a capture fails it ("Cannot copy between CPU and CUDA
tensors during CUDA graph capture"), and the shape then runs uncaptured for good; a read back
syncs. Each family's inputs are the ones its adapter builds for a real batched step of its
tiny model (two requests with prompts of different lengths, CFG where the family runs it);
the forward, built by `accelerate_transformer` as the engine builds it, runs on the meta device
under the guard of host_copies.py (the Qwen-Image family: test_qwen_image_sync_free.py, with
the controls showing the guard sees diffusers' copies there). A CPU run: what the guard cannot
see (a copy inside a C++ op) is only seen on a GPU, by bench_dit_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from family_helpers import noise_image
from host_copies import HostDeviceCopies, copies_in_warm_call, on_meta, record_steps, to_meta

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.acceleration import accelerate_transformer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: per-op overhead
SIZE = 64
PROMPTS = ("a cat", "a very small red house by a lake at dawn")


def family_fields(family: str, engine: DiffusionEngine, i: int) -> dict:
    """What a request of `family` needs besides its prompt (CFG where the family takes it)."""
    if family == "glm-image":  # the AR stage's prior tokens
        pipe = engine.adapter.pipe
        vocab = int(pipe.transformer.config.prior_vq_quantizer_codebook_size)
        g = torch.Generator("cpu").manual_seed(i)
        codes = torch.randint(0, vocab, (1, (SIZE // 32) ** 2), generator=g)
        return {"prior_token_ids": pipe._upsample_token_ids(codes, SIZE // 32, SIZE // 32)}
    if family == "wan":
        return {"num_frames": 5, "negative_prompt": "blurry"}
    if family == "flux2-klein":  # an edit: the source image's tokens join the sequence
        return {"input_images": [noise_image(i, (SIZE, SIZE))]}
    return {}


@pytest.mark.parametrize("family", ["flux", "flux2-klein", "z-image", "glm-image", "wan"])
def test_a_batched_step_copies_nothing_between_host_and_device(family, tiny_models):
    engine = DiffusionEngine(
        DiffusionEngineConfig(model=str(tiny_models(family)), max_batch_size=4)
    )
    requests = [
        GenerationRequest(
            f"r{i}", p, height=SIZE, width=SIZE, num_inference_steps=2, seed=i,
            **family_fields(family, engine, i),
        )
        for i, p in enumerate(PROMPTS)
    ]  # fmt: skip
    steps = record_steps(engine, requests)
    assert len(steps) == 2  # 2 steps, both requests in each forward (alone it would be 4)
    _, kwargs = steps[0]
    meta = on_meta(engine.adapter.pipe.transformer)
    step = accelerate_transformer(meta, torch.device("meta"))
    seen, out = copies_in_warm_call(step, to_meta(kwargs))
    assert seen == [], f"{family}: host<->device copies in the forward: {seen}"
    assert out[0] is not None


def test_the_guard_sees_each_kind_of_copy():
    """The guard is not blind: an upload, a move and a read back of a meta tensor."""
    meta = torch.device("meta")
    x = torch.zeros(2, device=meta)
    with HostDeviceCopies() as guard:
        torch.tensor([1, 2], device=meta)
        torch.ones(2).to(meta)
        x.copy_(torch.ones(2))
        torch.zeros(2, device=meta) + torch.arange(2, device=meta)  # device-only: not seen
        try:
            x.tolist()
        except (NotImplementedError, RuntimeError):
            pass  # meta has no data; the call is what counts
    assert guard.seen == ["tensor", "to", "copy_", "tolist"]
