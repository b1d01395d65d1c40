"""A device error in a diffusion step fails the engine (DeviceError), not just the batch; any
other error fails only the requests of that phase. The stage-level consequence (the stage
process exits and is restarted, requests get 503) is tested in tests/serving/test_failure_paths.py.
"""

from __future__ import annotations

import pytest
import torch

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.errors import DeviceError
from vllm_omni_plugin.diffusion.runner import (
    FAULT_PROMPT_ENV,
    injected_device_error,
    is_device_error,
)

FAULT = "this prompt raises a device error"


@pytest.mark.parametrize(
    "exc, device",
    [
        (injected_device_error(), True),
        (RuntimeError("CUDA error: device-side assert triggered"), True),
        (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasSgemm"), True),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"), False),
        (ValueError("CUDA error: in a ValueError's text is still a bad value"), False),
    ],
)
def test_device_error_classification(exc, device):
    assert is_device_error(exc) is device


def test_fault_injection_is_inert_by_default(tiny_models, monkeypatch):
    monkeypatch.delenv(FAULT_PROMPT_ENV, raising=False)
    engine = DiffusionEngine(DiffusionEngineConfig(model=str(tiny_models("qwen-image"))))
    assert engine.runner._fault_prompt is None
    (out,) = engine.generate([_req("a", FAULT)])
    assert out.error is None and len(out.images) == 1


def test_device_error_fails_the_engine_not_the_batch(tiny_models, monkeypatch):
    monkeypatch.setenv(FAULT_PROMPT_ENV, FAULT)
    engine = DiffusionEngine(DiffusionEngineConfig(model=str(tiny_models("qwen-image"))))
    engine.add_request(_req("ok", "a red bicycle"))
    engine.add_request(_req("bad", FAULT))
    with pytest.raises(DeviceError) as info:
        while engine.has_unfinished():
            engine.step()
    assert isinstance(info.value.__cause__, getattr(torch, "AcceleratorError", RuntimeError))


def _req(request_id: str, prompt: str) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        prompt=prompt,
        height=64,
        width=64,
        num_inference_steps=2,
        seed=0,
    )
