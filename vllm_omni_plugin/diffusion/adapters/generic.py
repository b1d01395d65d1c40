"""Fallback for any other diffusers text-to-image pipeline: run it whole, one request at a time.

No step batching, but the same request validation, per-request generator, progress (through
`callback_on_step_end`) and outputs, so unsupported families still serve.
"""

from __future__ import annotations

import inspect
from typing import Any

from PIL import Image

from ..request import RequestState
from .base import DiffusionAdapter, FamilySpec


class GenericAdapter(DiffusionAdapter):
    pipeline_class = "fallback"
    step_batched = False

    def __init__(self, pipe, device, dtype, defaults) -> None:
        super().__init__(pipe, device, dtype, defaults)
        self._params = set(inspect.signature(pipe.__call__).parameters)
        self._defaults = {
            name: p.default
            for name, p in inspect.signature(pipe.__call__).parameters.items()
            if p.default is not inspect.Parameter.empty
        }

    @property
    def spec(self) -> FamilySpec:
        vsf = int(getattr(self.pipe, "vae_scale_factor", 8))
        g = vsf * 2
        sample = getattr(self.pipe, "default_sample_size", None) or 128
        size = int(sample) * vsf
        steps = self._defaults.get("num_inference_steps") or 50
        guidance = self._defaults.get("guidance_scale")
        guidance = 5.0 if not isinstance(guidance, (int, float)) else float(guidance)
        return FamilySpec(g, size, size, int(steps), guidance, g, 2048)

    def cfg_facts(self) -> None:
        """An unknown pipeline's CFG rule is not known here: no field is refused for it."""
        return None

    def token_geometry(self, height: int, width: int) -> tuple[int, int, int]:
        tr = getattr(self.pipe, "transformer", None) or getattr(self.pipe, "unet", None)
        cfg = getattr(tr, "config", None)
        heads = int(getattr(cfg, "num_attention_heads", 8) or 8)
        head_dim = int(getattr(cfg, "attention_head_dim", 64) or 64)
        return (height // 16) * (width // 16) + 512, heads * head_dim, heads

    def batch_key(self, state: RequestState):
        return state.request_id  # never batched

    def prepare(self, states):  # pragma: no cover - whole-pipeline adapters skip phases
        raise NotImplementedError

    def denoise(self, states):  # pragma: no cover
        raise NotImplementedError

    def decode(self, states):  # pragma: no cover
        raise NotImplementedError

    def generate(self, state: RequestState, on_step: Any) -> list[Image.Image]:
        req = state.req
        kwargs: dict[str, Any] = {
            "prompt": req.prompt,
            "height": req.height,
            "width": req.width,
            "num_inference_steps": req.num_inference_steps,
            "generator": state.generator,
            "num_images_per_prompt": req.n,
        }
        if req.negative_prompt is not None and "negative_prompt" in self._params:
            kwargs["negative_prompt"] = req.negative_prompt
        if "guidance_scale" in self._params:
            kwargs["guidance_scale"] = req.guidance_scale
        if "callback_on_step_end" in self._params:

            def callback(pipe, i, t, tensors):
                on_step(i + 1)
                return {}

            kwargs["callback_on_step_end"] = callback
            kwargs["callback_on_step_end_tensor_inputs"] = []
        kwargs = {k: v for k, v in kwargs.items() if k in self._params}
        result = self.pipe(**kwargs, output_type="pil")
        on_step(req.num_inference_steps)
        return list(result.images)
