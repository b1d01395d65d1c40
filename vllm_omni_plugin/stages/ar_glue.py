"""Pipeline-specific glue of an AR stage: request -> (prompt ids, SamplingParams), and the
generated tokens -> the payload the next stage consumes. One class per AR pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..common.errors import RequestValidationError
from ..common.messages import GenerationParams
from .tokenizer_folder import with_model_config


class GlmImageGlue:
    """GLM-Image: exact image-token budget, then prior ids. Text-to-image: a token prompt.
    Image-to-image (`params.input_images`): the source images go to vLLM as multimodal data
    next to a prompt with one `<|image|>` per image (vLLM's processor expands it), the AR
    writes the large grid only; the DiT stage conditions on the same images itself."""

    def __init__(self, stage: Any):
        from vllm_omni_plugin.families.glm_image import processing

        self.processing = processing
        self.model_dir = str(stage.model_path)
        # The processor (chat template + grid tokens) lives in the pipeline's processor/.
        self.processor_dir = str(stage.tokenizer_path or Path(self.model_dir).parent / "processor")
        self.defaults = stage.sampling.sampling_kwargs()

    def engine_tokenizer(self, tokenizer: str | None) -> str | None:
        """What vLLM gets as `tokenizer`: the processor folder seen with the AR model's
        config.json (tokenizer_folder.py: no 2 s config retry per process at start)."""
        return with_model_config(tokenizer, self.model_dir)

    def prepare(self, params: GenerationParams):
        from vllm import SamplingParams

        h, w = self._size(params)
        try:
            self.processing.target_grids(h, w)
        except ValueError as exc:  # every ValueError of target_grids is about the size
            raise RequestValidationError("size", str(exc)) from None
        edit = bool(params.input_images)
        if edit:
            prompt = self._i2i_prompt(params, h, w)
        else:
            prompt_ids = self.processing.build_t2i_prompt(self.processor_dir, params.prompt, h, w)
            prompt = {"prompt_token_ids": prompt_ids}
        kwargs = dict(self.defaults)
        overrides = self.processing.t2i_sampling_overrides(self.model_dir, h, w, preview=not edit)
        extra = {**kwargs.pop("extra_args", {}), **overrides.pop("extra_args", {})}
        kwargs.update(overrides)
        kwargs["extra_args"] = extra
        kwargs["n"] = 1  # one prior per prompt; the DiT repeats it for n images, as diffusers
        if params.seed is not None:
            kwargs["seed"] = int(params.seed)
        return prompt, SamplingParams(**kwargs)

    def _i2i_prompt(self, params: GenerationParams, h: int, w: int) -> dict:
        import io

        from PIL import Image

        processor = self.processing.load_processor(self.processor_dir)
        bounds = self.processing.source_pixel_bounds(processor)
        images = []
        for data in params.input_images:
            try:
                images.append(
                    self.processing.fit_source_image(Image.open(io.BytesIO(data)), *bounds)
                )
            except ValueError as exc:  # aspect ratio the vision tokenizer refuses
                raise RequestValidationError("image", str(exc)) from None
        ids = self.processing.build_i2i_prompt(processor, params.prompt, images, h, w)
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}

    def to_payload(self, token_ids: list[int], params: GenerationParams):
        h, w = self._size(params)
        preview = not params.input_images
        return self.processing.tokens_to_prior_token_ids(token_ids, h, w, preview=preview)

    @staticmethod
    def _size(params: GenerationParams) -> tuple[int, int]:
        if params.height is None or params.width is None:
            # Serving always fills the size from the final stage's limits.
            raise ValueError("GLM-Image needs the request's height and width")
        return int(params.height), int(params.width)


_GLUES = {"glm_image": GlmImageGlue}


class ChatOnlyGlue:
    """A pipeline's chat stage that is nothing else (a text-only deployment): it answers vLLM's
    own chat and completion requests (GenerateText, ar_text.py), never a pipeline Submit."""

    def __init__(self, stage: Any):
        self.defaults = stage.sampling.sampling_kwargs()

    def engine_tokenizer(self, tokenizer: str | None) -> str | None:
        return tokenizer

    def prepare(self, params: GenerationParams):
        raise RequestValidationError(
            "prompt", "this stage answers /v1/chat/completions and /v1/completions only"
        )

    def to_payload(self, token_ids: list[int], params: GenerationParams):
        raise AssertionError("prepare refuses every pipeline request")


def glue_for(pipeline: str, stage: Any, chat_only: bool = False):
    """The pipeline's glue for `stage`; ChatOnlyGlue for a chat stage of a pipeline with no
    glue of its own (`chat_only`: the stage is its topology's chat stage)."""
    if pipeline not in _GLUES and chat_only:
        return ChatOnlyGlue(stage)
    if pipeline not in _GLUES:
        raise ValueError(f"no AR stage glue for pipeline {pipeline!r}; known: {sorted(_GLUES)}")
    return _GLUES[pipeline](stage)
