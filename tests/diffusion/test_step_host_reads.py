"""A warm denoising step reads nothing back from the device in the adapters' own code.

On a GPU each such read (`.item()`, `bool(t.all())`, `nonzero`, ...) makes the host wait for
the step's kernels, so the next step's Python work no longer overlaps the current step's GPU
work. The transformer's own forward is diffusers' and is left out here (GLM-Image's runs
sync-free, tests/diffusion/test_acceleration_speed.py). Uploads from the host cannot be told
apart on a CPU; `benchmarks/bench_dit_gpu.py` counts every kind of sync per step on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest

SIZE = 64
READS_BACK = {
    "aten._local_scalar_dense.default",  # .item(), bool(), int(), float() of a tensor
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten.is_nonzero.default",
    "aten.equal.default",
}


class ReadBacks(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []
        self.paused = 0  # inside the transformer's forward
        self.calls = 0  # denoise calls seen, the first one unwatched

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and str(func) in READS_BACK:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def watch_warm_steps(engine: DiffusionEngine) -> ReadBacks:
    """Record read-backs in every denoise call after the first, outside the transformer."""
    adapter = engine.adapter
    mode = ReadBacks()
    module = adapter.pipe.transformer
    module.register_forward_pre_hook(lambda *_: setattr(mode, "paused", mode.paused + 1))
    module.register_forward_hook(lambda *_: setattr(mode, "paused", mode.paused - 1))
    denoise = adapter.denoise

    def watched(states):
        mode.calls += 1
        if mode.calls == 1:
            return denoise(states)
        with mode:
            return denoise(states)

    adapter.denoise = watched
    return mode


def requests(family: str, engine: DiffusionEngine) -> list[GenerationRequest]:
    # Two prompts of different lengths and CFG: Qwen-Image pads and masks its text rows.
    prompts = ["a cat", "a very small red house by a lake at dawn"]
    extra = [{}, {}]
    if family == "glm-image":
        pipe = engine.adapter.pipe
        vocab = int(pipe.transformer.config.prior_vq_quantizer_codebook_size)
        g = torch.Generator("cpu").manual_seed(0)
        for e in extra:
            codes = torch.randint(0, vocab, (1, (SIZE // 32) ** 2), generator=g)
            e["prior_token_ids"] = pipe._upsample_token_ids(codes, SIZE // 32, SIZE // 32)
    # Qwen-Image: no guidance_scale (not guidance-distilled), its true CFG default (4.0).
    guidance = {"flux": 3.5, "qwen-image": None, "glm-image": 1.5}[family]
    negative = "blurry" if family == "qwen-image" else None
    return [
        GenerationRequest(
            f"r{i}",
            p,
            negative_prompt=negative,
            height=SIZE,
            width=SIZE,
            num_inference_steps=4,
            guidance_scale=guidance,
            seed=i,
            **e,
        )
        for i, (p, e) in enumerate(zip(prompts, extra, strict=True))
    ]


@pytest.mark.parametrize("family", ["flux", "qwen-image", "glm-image"])
def test_warm_steps_read_nothing_back(family, tiny_models):
    engine = DiffusionEngine(DiffusionEngineConfig(model=str(tiny_models(family))))
    mode = watch_warm_steps(engine)
    outputs = engine.generate(requests(family, engine))
    assert [len(o.images) for o in outputs] == [1, 1]
    assert mode.calls >= 3, f"only {mode.calls} denoise calls: nothing warm was checked"
    assert mode.seen == [], f"{family}: the adapter read the device back {mode.seen}"
