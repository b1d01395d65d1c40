"""The adapter contract: one model family's math, split into batched phases.

The engine never touches a model directly. For each family an adapter turns a list of request
states into batched work: `prepare` (text encoding for all newly admitted requests in one call,
plus each request's own latents and schedule), `denoise` (one step for a group of requests, each
at its own step index, CFG rows in the same forward) and `decode` (one VAE call).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from PIL import Image

from ...common.knobs import CfgFacts, Knob, unused_field
from ...common.memory import MemoryModel
from ..errors import RequestValidationError
from ..request import GenerationRequest, RequestState


@dataclass(frozen=True)
class FamilySpec:
    """Per-family request bounds and the diffusers defaults of its pipeline."""

    granularity: int  # height and width must be multiples of this
    default_height: int
    default_width: int
    default_steps: int
    default_guidance: float
    min_size: int
    max_size: int


class DiffusionAdapter(ABC):
    """Base class; subclasses set `pipeline_class` and implement the phases."""

    pipeline_class: ClassVar[str] = ""
    # The family's name in messages to users ("Qwen-Image"); the pipeline class when empty.
    family: ClassVar[str] = ""
    # Request fields this family applies beyond the routes' common ones, under diffusers' names
    # (checked in the API server from the stage's Ready info, and again by the engine).
    knobs: ClassVar[tuple[Knob, ...]] = ()
    # Common request fields this family does not apply -> why (a request that sets one is
    # refused, never answered as if it had been applied).
    unsupported: ClassVar[dict[str, str]] = {}
    # False: the adapter runs each request whole (`generate`), no step batching.
    step_batched: ClassVar[bool] = True
    # model_index.json components this stage never needs (not read from disk).
    skip_components: ClassVar[tuple[str, ...]] = ()
    # Edits: source images one request may carry (`GenerationRequest.input_images`; 0: text
    # to image only), whether it must carry one, and whether it inpaints with a mask.
    max_input_images: ClassVar[int] = 0
    requires_input_image: ClassVar[bool] = False
    accepts_mask: ClassVar[bool] = False
    # LoRA: the transformer modules adapters may adapt, as module-name prefixes (every nn.Linear
    # under one of them); empty: the family takes no LoRA (a stage with `lora` refuses to start).
    lora_targets: ClassVar[tuple[str, ...]] = ()
    # The pipeline's transformers adapters adapt, in expert order (diffusers' LoRA-loadable
    # denoisers; Wan2.2: `transformer`, then `transformer_2`, the low-noise expert).
    lora_experts: ClassVar[tuple[str, ...]] = ("transformer",)

    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, defaults: dict) -> None:
        self.pipe = pipe
        self.device = device
        self.dtype = dtype
        self.defaults = dict(defaults)
        # The module the denoising loop calls; the engine may swap in a compiled wrapper.
        self.transformer = pipe.transformer
        # The engine's StepCache (step_cache/runtime.py) when the stage enables step caching.
        self.step_cache: Any = None
        # The engine's LoraStore (lora/store.py) when the stage serves LoRA adapters.
        self.lora: Any = None

    def lora_models(self) -> list[torch.nn.Module]:
        """The transformers of `lora_experts` this checkpoint has (Wan2.1: no `transformer_2`)."""
        found = [getattr(self.pipe, name, None) for name in self.lora_experts]
        return [m for m in found if m is not None]

    def cached_models(self) -> list[torch.nn.Module]:
        """The transformers whose blocks the step cache wraps (Wan2.2: both experts)."""
        return [self.pipe.transformer]

    # ---- facts -------------------------------------------------------------------------
    @property
    @abstractmethod
    def spec(self) -> FamilySpec: ...

    def uses_cfg(self, req: GenerationRequest) -> bool:
        """Whether this (validated) request runs an unconditional pass, as diffusers decides."""
        return False

    def check_request(self, req: GenerationRequest) -> None:
        """Family-specific validation (raise RequestValidationError)."""
        return None

    def applied_knobs(self) -> tuple[Knob, ...]:
        """The knobs the loaded model applies (a family may drop some for a variant)."""
        return self.knobs

    def cfg_facts(self) -> CfgFacts | None:
        """How this family decides on CFG (None: no rule, e.g. a whole-pipeline adapter).
        Default: CFG when guidance_scale > 1, with or without a negative prompt."""
        return CfgFacts(
            scale_field="guidance_scale",
            default_scale=float(self.defaults.get("guidance_scale", self.spec.default_guidance)),
            needs_negative=False,
            default_negative=self.defaults.get("negative_prompt") is not None,
            guidance_used=True,
        )

    def check_applied(self, given: GenerationRequest) -> None:
        """Refuse a field the request set (`given`, before defaults) that the model would not
        use: a field of `unsupported`, or one the family's CFG rule leaves unread."""
        for name, why in self.unsupported.items():
            if getattr(given, name, None) is not None:
                raise RequestValidationError(name, why)
        facts = self.cfg_facts()
        if facts is None:
            return
        fields = {
            "guidance_scale": given.guidance_scale,
            "negative_prompt": given.negative_prompt,
            **given.knobs,
        }
        unused = unused_field(facts, fields)
        if unused is not None:
            raise RequestValidationError(*unused)

    def weight_bytes(self) -> int:
        total = 0
        for module in self.pipe.components.values():
            if isinstance(module, torch.nn.Module):
                total += sum(p.numel() * p.element_size() for p in module.parameters())
        return total

    def row_bytes(self, height: int, width: int) -> int:
        """Estimated activation bytes of one image of this size without CFG: the memory plan's
        arithmetic (common/memory.py) on this family's facts."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        model = MemoryModel(budget_bytes=0, limit="", element_bytes=elem, **self.memory_facts())
        return model.request_bytes(height, width)

    def output_frames(self, req: GenerationRequest) -> int:
        """Frames each output of a validated request has (video families: the video's)."""
        return 1

    def memory_facts(self) -> dict[str, Any]:
        """The family's facts for the memory plan (common/memory.py MemoryModel), read off
        `token_geometry` on the size grid: tokens per grid square, and the rest of a row's
        tokens (text and fixed conditions). Video and edit families add theirs."""
        g = self.spec.granularity
        one, hidden, heads = self.token_geometry(g, g)
        block_tokens = self.token_geometry(2 * g, g)[0] - one
        return {
            "block": g,
            "block_tokens": block_tokens,
            "text_tokens": one - block_tokens,
            "hidden": hidden,
            "heads": heads,
        }

    def token_geometry(self, height: int, width: int) -> tuple[int, int, int]:
        """(sequence tokens incl. text, transformer width, attention heads) for one row."""
        return self.grid_token_geometry(height, width, grid=16, text_tokens=512)

    def grid_token_geometry(
        self, height: int, width: int, grid: int, text_tokens: int
    ) -> tuple[int, int, int]:
        """token_geometry of a transformer with one token per `grid` x `grid` pixels and
        `text_tokens` of text, its width and heads from num_attention_heads x attention_head_dim."""
        cfg = self.pipe.transformer.config
        heads = int(cfg.num_attention_heads)
        tokens = (height // grid) * (width // grid) + text_tokens
        return tokens, heads * int(cfg.attention_head_dim), heads

    # ---- phases ------------------------------------------------------------------------
    def batch_key(self, state: RequestState) -> Hashable:
        """Requests with equal keys may share a denoising forward."""
        return (state.req.height, state.req.width, state.do_cfg)

    def prepares_aside(self, state: RequestState) -> bool:
        """Whether this request's `prepare` may run on the side lane, beside other requests'
        denoising (`overlap_encode_decode`). False where it would call a module the denoising
        calls too: the engine thread then prepares it, as without the side lane."""
        return True

    @abstractmethod
    def prepare(self, states: list[RequestState]) -> None:
        """Encode prompts (batched), draw latents with each request's generator, set schedules."""

    @abstractmethod
    def denoise(self, states: list[RequestState]) -> None:
        """Advance every state by one step (its own `state.step`), updating `state.latents`."""

    @abstractmethod
    def decode(self, states: list[RequestState]) -> list[list[Image.Image]]:
        """Decode finished states in one VAE call; one list of n images per state."""

    def preview(self, states: list[RequestState]) -> list[list[Image.Image]]:
        """Decode each state's x0 prediction (left by `euler_update`) with the family's own
        VAE decode, in one call: a streaming preview costs one decode of that request's images."""
        saved = [s.latents for s in states]
        try:
            for s in states:
                s.latents = s.x0
            return self.decode(states)
        finally:
            for s, latents in zip(states, saved, strict=True):
                s.latents = latents
                s.x0 = None

    def forward_groups(self, forward: Any, groups: list[Any]) -> list[torch.Tensor]:
        """Run one step's separate forwards (row groups); CFG parallelism replaces this on the
        instance to spread the groups over its ranks (diffusion/parallel/cfg.py)."""
        return [forward(g) for g in groups]

    def run_transformer(
        self, model: Any, rows: list[tuple[RequestState, str, int]], kwargs: dict, expert: int = 0
    ) -> tuple[torch.Tensor, ...]:
        """`model(**kwargs)`, through the step cache when the stage has one. `rows`: the batch's
        row groups in order, (state, "cond" or "uncond", rows); with LoRA, each row gets its
        request's adapters."""
        if self.lora is not None:
            with self.lora.rows(rows, expert):
                return model(**kwargs)
        if self.step_cache is None:
            return model(**kwargs)
        return self.step_cache.run(model, rows, kwargs, expert)

    def run_guided(
        self,
        model: Any,
        states: list[RequestState],
        kwargs: dict,
        guide: Callable[[RequestState, torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        expert: int = 0,
        keep_tokens: int | None = None,
    ) -> list[torch.Tensor]:
        """One batched step's transformer call and CFG, in the row layout of the batched
        families: every state's `n` conditioned rows in order, then the unconditioned rows of
        the states running CFG (`s.do_cfg`), in the same order. Runs `model` on `kwargs`
        (`run_transformer`: step cache, LoRA), keeps each row's first `keep_tokens` tokens when
        given (the noisy latents, when source-image tokens follow them) and returns each
        state's noise prediction: its conditioned rows, or `guide(s, cond, uncond)` for a CFG
        state (the family's guidance rule). What the step does with it stays the family's."""
        cfg_states = [s for s in states if s.do_cfg]
        tags = [(s, "cond", s.n) for s in states] + [(s, "uncond", s.n) for s in cfg_states]
        pred = self.run_transformer(model, tags, kwargs, expert)[0]
        if keep_tokens is not None:
            pred = pred[:, :keep_tokens]
        out, i, j = [], 0, sum(s.n for s in states)
        for s in states:
            noise = pred[i : i + s.n]
            if s.do_cfg:
                noise = guide(s, noise, pred[j : j + s.n])
                j += s.n
            out.append(noise)
            i += s.n
        return out

    def generate(self, state: RequestState, on_step: Any) -> list[Image.Image]:
        raise NotImplementedError  # only whole-pipeline adapters implement this

    # ---- helpers shared by the flow-matching families ----------------------------------
    def euler_update(self, states: list[RequestState], noise_pred: torch.Tensor) -> None:
        """FlowMatchEulerDiscreteScheduler.step for many requests at their own sigma index.

        Same arithmetic as diffusers: sample upcast to float32, `sample + dt * model_output`,
        cast back to the model output's dtype.
        """
        dts = []
        for s in states:
            dt = s.sigmas[s.step + 1] - s.sigmas[s.step]
            dts.append(dt.expand(s.n))
        dt = torch.cat(dts).view(-1, *([1] * (noise_pred.dim() - 1)))
        sample = torch.cat([s.latents for s in states]).to(torch.float32)
        prev = (sample + dt * noise_pred).to(noise_pred.dtype)
        sizes = [s.n for s in states]
        for i, (s, chunk) in enumerate(zip(states, prev.split(sizes), strict=True)):
            s.latents = chunk
            if s.step in s.preview_at:
                # Flow matching: x_t = (1 - sigma) x0 + sigma * noise, v = noise - x0, so the
                # model's current estimate of the clean latents is x_t - sigma * v.
                lo = sum(sizes[:i])
                v = noise_pred[lo : lo + s.n].to(torch.float32)
                s.x0 = (sample[lo : lo + s.n] - s.sigmas[s.step] * v).to(chunk.dtype)

    def set_schedule(self, state: RequestState, timesteps: torch.Tensor) -> None:
        """Copy the scheduler's freshly computed schedule into the request (per-request state).

        Both on the adapter's device (diffusers keeps sigmas on the CPU): the per-step update
        then reads no host data, which on a GPU would be a blocking copy every step.
        """
        state.timesteps = timesteps.to(self.device, copy=True)
        state.sigmas = self.pipe.scheduler.sigmas.to(self.device, copy=True)

    def postprocess(self, images: torch.Tensor) -> list[Image.Image]:
        return self.pipe.image_processor.postprocess(images, output_type="pil")


def split_images(images: list[Image.Image], states: list[RequestState]) -> list[list[Image.Image]]:
    out, i = [], 0
    for s in states:
        out.append(images[i : i + s.n])
        i += s.n
    return out


def check_flow_match_scheduler(scheduler: Any) -> None:
    """The batched Euler update assumes deterministic flow-matching Euler steps."""
    name = type(scheduler).__name__
    if name != "FlowMatchEulerDiscreteScheduler":
        raise TypeError(f"step batching needs FlowMatchEulerDiscreteScheduler, got {name}")
    if getattr(scheduler.config, "stochastic_sampling", False):
        raise TypeError("stochastic_sampling schedulers are not step-batched")
