"""Pipeline-specific glue of an AR stage: request -> (prompt ids, SamplingParams), and the
generated tokens -> the payload the next stage consumes. One class per AR pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..diffusion.errors import RequestValidationError
from .messages import GenerationParams


class GlmImageGlue:
    """GLM-Image text-to-image (team D's helpers): exact image-token budget, then prior ids."""

    def __init__(self, stage: Any):
        from vllm_omni_plugin.models.glm_image import processing

        self.processing = processing
        self.model_dir = str(stage.model_path)
        # The processor (chat template + grid tokens) lives in the pipeline's processor/.
        self.processor_dir = str(stage.tokenizer_path or Path(self.model_dir).parent / "processor")
        self.defaults = stage.sampling.sampling_kwargs()

    def prepare(self, params: GenerationParams):
        from vllm import SamplingParams

        h, w = self._size(params)
        try:
            self.processing.target_grids(h, w)
        except ValueError as exc:  # every ValueError of target_grids is about the size
            raise RequestValidationError("size", str(exc)) from None
        prompt_ids = self.processing.build_t2i_prompt(self.processor_dir, params.prompt, h, w)
        kwargs = dict(self.defaults)
        overrides = self.processing.t2i_sampling_overrides(self.model_dir, h, w)
        extra = {**kwargs.pop("extra_args", {}), **overrides.pop("extra_args", {})}
        kwargs.update(overrides)
        kwargs["extra_args"] = extra
        kwargs["n"] = 1  # one prior per prompt; the DiT repeats it for n images, as diffusers
        if params.seed is not None:
            kwargs["seed"] = int(params.seed)
        return prompt_ids, SamplingParams(**kwargs)

    def to_payload(self, token_ids: list[int], params: GenerationParams):
        h, w = self._size(params)
        return self.processing.tokens_to_prior_token_ids(token_ids, h, w)

    @staticmethod
    def _size(params: GenerationParams) -> tuple[int, int]:
        if params.height is None or params.width is None:
            # Serving always fills the size from the final stage's limits.
            raise ValueError("GLM-Image needs the request's height and width")
        return int(params.height), int(params.width)


_GLUES = {"glm_image": GlmImageGlue}


def glue_for(pipeline: str, stage: Any):
    if pipeline not in _GLUES:
        raise ValueError(f"no AR stage glue for pipeline {pipeline!r}; known: {sorted(_GLUES)}")
    return _GLUES[pipeline](stage)
