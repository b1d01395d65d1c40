"""Qwen-Image's padded batch step copies nothing between host and device (issue 32: on the H200
the batch-8 shape's CUDA graph capture failed with "Cannot copy between CPU and CUDA tensors
during CUDA graph capture", and that shape ran uncaptured).

The cause was diffusers' forward with an `encoder_hidden_states_mask` (prompts of different
lengths share a forward): `torch.as_tensor(text_seq_len, device=...)`, a host-to-device copy in
every call. A CPU has no device to copy to, so the step runs here on the meta device (shapes
without data: a copy from host memory onto it is still a call that puts host data on a
non-CPU device) under a guard that records every such call and every read back; the inputs
are the ones the Qwen-Image adapter builds for a real batched step of the tiny model. As
StepGraphs does before a capture, one warm call runs first (lazy caches: RoPE tables moved to
the device once). The same forward without the fix is the control: the guard sees its copy.
The outputs equal diffusers' own forward with the mask bit for bit (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.acceleration import accelerate_transformer
from vllm_omni_plugin.diffusion.qwen_image_sync_free import SyncFreeQwen

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: per-op overhead
SIZE = 64
FROM_HOST = {"tensor", "as_tensor", "asarray", "from_numpy"}  # host data -> a new tensor
MOVES = {"to", "cuda", "copy_", "_to_copy"}  # a tensor's data to another device
READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}


def _device(value) -> str | None:
    return value.device.type if isinstance(value, torch.Tensor) else None


class HostDeviceCopies(TorchFunctionMode):
    """Records each torch call that moves data between the host and a non-CPU device."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        source = _device(
            args[1] if name == "copy_" and len(args) > 1 else args[0] if args else None
        )
        if name in READS and source not in (None, "cpu"):
            self.seen.append(name)
        out = func(*args, **(kwargs or {}))
        target = _device(args[0] if name == "copy_" else out)
        if name in FROM_HOST and target not in (None, "cpu"):
            self.seen.append(name)
        if name in MOVES and source and target and (source == "cpu") != (target == "cpu"):
            self.seen.append(name)
        return out


@pytest.fixture(scope="module")
def engine(tiny_models):
    return DiffusionEngine(
        DiffusionEngineConfig(model=str(tiny_models("qwen-image")), max_batch_size=2)
    )


@pytest.fixture(scope="module")
def step_inputs(engine):
    """The transformer's keyword arguments in one batched step of two prompts of different
    lengths, as the adapter builds them."""
    adapter, seen = engine.adapter, []
    inner = adapter.transformer

    def record(**kwargs):
        seen.append(tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, kwargs))
        return inner(**kwargs)

    adapter.transformer = record
    try:
        engine.generate(
            [
                GenerationRequest("short", "a cat", height=SIZE, width=SIZE, num_inference_steps=2, seed=1),
                GenerationRequest(
                    "long", "a red cube on a table by the window at dusk", height=SIZE,
                    width=SIZE, num_inference_steps=2, seed=2,
                ),
            ]
        )  # fmt: skip
    finally:
        adapter.transformer = inner
    assert len(seen) == 2  # one forward per step for both requests (2 steps)
    kwargs = seen[0]
    assert kwargs["hidden_states"].shape[0] == 2
    assert kwargs["encoder_hidden_states_mask"] is not None  # padded: the mask path
    return kwargs


def test_the_engine_runs_qwen_image_through_the_sync_free_call(engine, step_inputs):
    assert isinstance(engine.adapter.transformer, SyncFreeQwen)
    tr = engine.adapter.pipe.transformer
    with torch.no_grad():
        ours = engine.adapter.transformer(**step_inputs)[0]
        theirs = tr(**step_inputs)[0]  # diffusers' forward, its own mask path
        unmasked = tr(**{**step_inputs, "encoder_hidden_states_mask": None})[0]
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, unmasked)  # the mask matters: the comparison is not vacuous


def test_a_padded_batch_step_copies_nothing_between_host_and_device(engine, step_inputs):
    from diffusers import QwenImageTransformer2DModel

    config = engine.adapter.pipe.transformer.config
    with torch.device("meta"):
        on_device = QwenImageTransformer2DModel.from_config(config)
    device = torch.device("meta")
    # What the engine calls, built for the device (no CUDA graphs off CUDA: the wrapper alone).
    step = accelerate_transformer(on_device, device)
    assert isinstance(step, SyncFreeQwen)
    inputs = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, step_inputs)
    with torch.no_grad():
        step(**inputs)  # the warm call StepGraphs makes before capturing
        with HostDeviceCopies() as fixed:
            out = step(**inputs)[0]
        with HostDeviceCopies() as plain:
            on_device(**inputs)  # diffusers' forward with the mask: the control
    assert out.shape == step_inputs["hidden_states"].shape
    assert fixed.seen == []
    assert plain.seen == ["as_tensor"]
