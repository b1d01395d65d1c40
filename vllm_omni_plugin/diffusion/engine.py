"""The diffusion engine: request queue -> scheduler -> runner -> outputs.

    batch = scheduler.schedule(); out = runner.run(batch); outputs = scheduler.update(batch, out)

Thread-safe for `add_request` / `abort` / `progress` from other threads while one thread drives
`step()`: the lock covers the scheduler's bookkeeping, not the model run.

With `overlap_encode_decode`, prepare and decode run on the side lane (side_lane.py) while
`step()` denoises; each step's schedule first collects what the lane finished.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import threading
import time
import weakref
from typing import Any

import torch

from ..common.cache_policy import NONE, CachePolicy, CachePolicyError
from ..common.knobs import KnobError, check_knobs
from ..common.limits import MAX_PARTIAL_IMAGES, MAX_SEED, RequestLimits, size_granularity
from ..common.lora_files import LoraError
from ..common.memory import row_tokens
from .acceleration import AccelerationError, accelerate_transformer
from .adapters.base import DiffusionAdapter
from .adapters.loader import configure_vae, load_pipeline, torch_dtype
from .adapters.registry import get_adapter_class, pipeline_class_of
from .config import DiffusionEngineConfig
from .errors import CapacityError, DiffusionEngineError, RequestValidationError
from .lora.setup import build_store, check_request
from .memory_plan import check_fits, plan_memory, request_shape, total_budget
from .outputs import GenerationOutput
from .phase_log import PhaseLog
from .request import GenerationRequest, RequestState, preview_steps
from .runner import ModelRunner
from .scheduler import ScheduledBatch, Scheduler
from .side_lane import SideLane
from .step_cache.runtime import StepCache, cache_bounds

__all__ = ["MAX_SEED", "DiffusionEngine"]

# A step with nothing to denoise while the side lane works waits this long at most for its
# results, then returns, so that a caller's loop still takes new requests and aborts meanwhile.
SIDE_LANE_WAIT_S = 0.05


class DiffusionEngine:
    def __init__(self, config: DiffusionEngineConfig, adapter: DiffusionAdapter | None = None):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.dtype)
        if config.max_batch_size < 1:
            raise DiffusionEngineError("max_batch_size must be >= 1")
        if config.max_batch_tokens is not None and config.max_batch_tokens < 1:
            raise DiffusionEngineError("max_batch_tokens must be >= 1")
        self._budget_bytes = total_budget(config, self.device)
        self.cache_bounds = cache_bounds(config)
        self.adapter = adapter or self._load_adapter()
        configure_vae(self.adapter.pipe, config.vae_use_slicing, config.vae_use_tiling)
        # LoRA first: it refuses the accelerations it cannot run under, and wraps the linears.
        self.lora = build_store(config, self.adapter, self.device, self.dtype)
        self.adapter.lora = self.lora
        try:
            self.adapter.transformer = accelerate_transformer(
                self.adapter.pipe.transformer,
                self.device,
                compile=config.compile_transformer,
                regional=config.compile_regional,
                mode=config.compile_mode,
                fullgraph=config.compile_fullgraph,
                dynamic=config.compile_dynamic,
                fuse_qkv=config.fuse_qkv,
                attention_backend=config.attention_backend,
                cuda_graphs=self._cuda_graphs(config),
                max_graphs=config.cuda_graph_max_graphs,
                fp8=config.fp8_linear,
                fuse_gelu=self._fuse_gelu(config),
                reversible=False,
                compile_cache_dir=config.compile_cache_dir,
            )
        except AccelerationError as exc:
            raise DiffusionEngineError(str(exc)) from exc
        self.step_cache = self._step_cache()
        self.adapter.step_cache = self.step_cache
        self.defaults: dict[str, Any] = dict(config.defaults or {})
        for name, why in self.adapter.unsupported.items():  # what requests get (check_applied)
            if self.defaults.get(name) is not None:
                raise DiffusionEngineError(f"default_sampling_params.{name}: {why}")
        # What requests may use once the weights are loaded, and what each one needs.
        self.memory = plan_memory(config, self.adapter, self._budget_bytes, self.device, self.dtype)
        self._activation_budget = None if self.memory is None else self.memory.budget_bytes
        # The family's token geometry, for max_batch_tokens (read only where it is set).
        self._row_facts = (
            self.adapter.memory_facts() if config.max_batch_tokens is not None else None
        )
        self.limits = self._limits()
        overlap = self._overlap(config)
        self.scheduler = Scheduler(
            config.max_batch_size,
            self.adapter.batch_key,
            cost=self._cost,
            budget=self._activation_budget,
            tokens=self._tokens if config.max_batch_tokens is not None else None,
            max_tokens=config.max_batch_tokens,
            step_batched=self.adapter.step_batched,
            max_wait_s=(config.request_batch_max_wait_ms or 0.0) / 1e3,
            admit=self._admit_lora,
            prepare_aside=self.adapter.prepares_aside if overlap else None,
        )
        self._lock = threading.Lock()
        self._progress: dict[str, tuple[int, int]] = {}
        self._previews: dict[str, tuple[int, list]] = {}
        self.phases = PhaseLog()  # what ran when, on which lane
        self.side_lane: SideLane | None = None
        if overlap:
            # Each job holds at least one admitted request: max_batch_size bounds them.
            self.side_lane = SideLane(self.adapter, self.device, config.max_batch_size, self.phases)
            # An engine dropped unclosed stops its worker; at exit the daemon thread just ends.
            weakref.finalize(self, self.side_lane.close).atexit = False
        self.runner = ModelRunner(self.adapter, self.side_lane, self.phases)

    def _load_adapter(self) -> DiffusionAdapter:
        cfg = self.config
        name = cfg.pipeline_class or pipeline_class_of(cfg.model)
        cls = get_adapter_class(name)
        pipe = load_pipeline(cfg.model, self.dtype, self.device, skip=cls.skip_components)
        return cls(pipe, self.device, self.dtype, dict(cfg.defaults or {}))

    def _fuse_gelu(self, config: DiffusionEngineConfig) -> bool:
        if config.fuse_gelu is not None:
            return config.fuse_gelu
        # LoRA adapts the up-projections the fusion would replace.
        return self.device.type == "cuda" and not config.fp8_linear and config.lora is None

    def _overlap(self, config: DiffusionEngineConfig) -> bool:
        """Whether prepare and decode run on the side lane (off unless asked for)."""
        asked = config.overlap_encode_decode
        if asked is False:
            return False
        why_not = None
        if not self.adapter.step_batched:
            family = type(self.adapter.pipe).__name__
            why_not = f"{family} runs each request as a whole pipeline (no separate phases)"
        elif config.world_size > 1:
            why_not = "cfg_parallel / ulysses_degree > 1: the follower ranks prepare in step"
        if why_not is not None:
            if asked:
                raise DiffusionEngineError(f"overlap_encode_decode: {why_not}")
            return False
        return bool(asked)

    def _caching(self) -> bool:
        return any(p != NONE for p in self.cache_bounds.policies)

    def _cuda_graphs(self, config: DiffusionEngineConfig) -> bool | None:
        """Off with LoRA: a graph would replay one plan of which rows take which adapter
        (cuda_graphs true was refused by the LoRA checks). Step caching keeps them: its forwards
        whose rows take per-row paths through the blocks run uncaptured (step_cache/runtime.py)."""
        if config.lora is not None:
            return False
        return config.cuda_graphs

    def _step_cache(self) -> StepCache | None:
        if not self._caching():
            return None
        cfg = self.config
        if cfg.world_size > 1:
            raise DiffusionEngineError(
                "step_cache with cfg_parallel/ulysses_degree is not supported: the ranks would "
                "decide separately"
            )
        if cfg.compile_transformer and not cfg.compile_regional:
            raise DiffusionEngineError(
                "step_cache needs compile_regional with compile_transformer (the per-row "
                "decisions sit between the compiled blocks)"
            )
        if not self.adapter.step_batched:
            return None  # whole-pipeline families: requests asking for a policy are refused
        try:
            return StepCache(self.adapter.cached_models())
        except TypeError as exc:
            raise DiffusionEngineError(f"step_cache: {exc}") from exc

    def _limits(self) -> RequestLimits:
        """The bounds `validate` enforces, which the stage announces to the API server."""
        spec, cfg, d = self.adapter.spec, self.config, self.defaults
        return RequestLimits(
            granularity=size_granularity(spec.granularity, cfg.size_granularity),
            min_height=cfg.min_height or spec.min_size,
            min_width=cfg.min_width or spec.min_size,
            max_height=cfg.max_height or spec.max_size,
            max_width=cfg.max_width or spec.max_size,
            max_steps=cfg.max_num_inference_steps,
            max_batch_size=cfg.max_batch_size,
            default_height=int(d.get("height", spec.default_height)),
            default_width=int(d.get("width", spec.default_width)),
        )

    def _tokens(self, state: RequestState) -> int:
        """Sequence tokens the request adds to one forward: each of its rows."""
        shape = request_shape(self.adapter, state.req, state.do_cfg)
        rows = shape["n"] * (2 if shape["cfg"] else 1)
        size = (shape["height"], shape["width"], shape["frames"], shape["sources"])
        return rows * row_tokens(self._row_facts, *size)

    def _cost(self, state: RequestState) -> int:
        assert self.memory is not None  # the scheduler asks only when there is a budget
        return self.memory.request_bytes(**request_shape(self.adapter, state.req, state.do_cfg))

    # ---- requests ----------------------------------------------------------------------
    def validate(self, req: GenerationRequest) -> GenerationRequest:
        """Fill defaults (stage config, else diffusers') and check every field."""
        spec = self.adapter.spec
        d = self.defaults
        if not isinstance(req.request_id, str) or not req.request_id:
            raise RequestValidationError("request_id", "must be a non-empty string")
        if not isinstance(req.prompt, str) or not req.prompt.strip():
            raise RequestValidationError("prompt", "must be a non-empty string")
        negative = (
            req.negative_prompt if req.negative_prompt is not None else d.get("negative_prompt")
        )
        if negative is not None and not isinstance(negative, str):
            raise RequestValidationError("negative_prompt", "must be a string")
        n = _int_field("n", req.n, 1, None)
        if n > self.config.max_batch_size:
            raise CapacityError(
                "n", f"{n} images exceed max_batch_size={self.config.max_batch_size}"
            )
        lim = self.limits
        g = lim.granularity
        filled = {}
        for name, default, lo, hi in (
            ("height", lim.default_height, lim.min_height, lim.max_height),
            ("width", lim.default_width, lim.min_width, lim.max_width),
        ):
            value = getattr(req, name)
            value = default if value is None else value
            value = _int_field(name, value, lo, hi)
            if value % g:
                raise RequestValidationError(name, f"{value} is not a multiple of {g}")
            filled[name] = value
        steps = req.num_inference_steps
        steps = d.get("num_inference_steps", spec.default_steps) if steps is None else steps
        steps = _int_field("num_inference_steps", steps, 1, lim.max_steps)
        guidance = req.guidance_scale
        guidance = d.get("guidance_scale", spec.default_guidance) if guidance is None else guidance
        if isinstance(guidance, bool) or not isinstance(guidance, (int, float)):
            raise RequestValidationError("guidance_scale", "must be a number")
        if not math.isfinite(guidance) or guidance < 0:
            raise RequestValidationError("guidance_scale", f"must be >= 0, got {guidance}")
        _int_field("partial_images", req.partial_images, 0, MAX_PARTIAL_IMAGES)
        _check_inputs(self.adapter, req)
        seed = req.seed if req.seed is not None else d.get("seed")
        if seed is not None:
            seed = _int_field("seed", seed, 0, lim.max_seed)
        try:
            knobs = check_knobs(self.adapter.applied_knobs(), dict(req.knobs))
        except KnobError as exc:
            raise RequestValidationError(exc.name, exc.message) from None
        cache = self._cache_policy(req)
        lora = check_request(self.lora, req.lora)
        out = dataclasses.replace(
            req,
            cache=cache,
            lora=lora,
            negative_prompt=negative,
            n=n,
            num_inference_steps=steps,
            guidance_scale=float(guidance),
            seed=seed,
            knobs=knobs,
            **filled,
        )
        self.adapter.check_request(out)
        self.adapter.check_applied(req)
        check_fits(self.memory, self.adapter, out, self.adapter.uses_cfg(out))
        return out

    def _cache_policy(self, req: GenerationRequest) -> CachePolicy:
        try:
            policy = self.cache_bounds.resolve(req.cache)
        except CachePolicyError as exc:
            raise RequestValidationError(exc.field, exc.message) from None
        if policy.active and self.step_cache is None:
            family = type(self.adapter.pipe).__name__
            raise RequestValidationError(
                "cache.policy", f"{policy.policy!r} is not available for {family}"
            )
        return policy

    def cache_skipped(self) -> dict[str, int]:
        """Transformer calls skipped by step caching since start, per policy (a request's
        step counts once, its CFG rows included)."""
        return {} if self.step_cache is None else self.step_cache.skipped()

    def add_request(self, req: GenerationRequest) -> GenerationRequest:
        req = self.validate(req)
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        state = RequestState(req=req, seed=seed, do_cfg=self.adapter.uses_cfg(req))
        # Exactly what diffusers gets from `generator=torch.Generator("cpu").manual_seed(seed)`.
        state.generator = torch.Generator("cpu").manual_seed(seed)
        if self.step_cache is not None:
            StepCache.attach(state, req.cache)
        if self.adapter.step_batched:  # whole-pipeline adapters have no step to preview after
            state.preview_at = preview_steps(req.num_inference_steps, req.partial_images)
        with self._lock:
            if self.scheduler.find(req.request_id) is not None:
                raise RequestValidationError("request_id", f"{req.request_id!r} is already running")
            self.scheduler.add(state)
            self._progress[req.request_id] = (0, req.num_inference_steps)
        return req

    def abort(self, request_id: str) -> bool:
        with self._lock:
            return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        """Whether `step()` has more to do: requests held, or aborted ones still to report or
        whose side-lane job is still out."""
        with self._lock:
            return self.scheduler.has_unfinished()

    def held(self) -> dict[str, tuple[int, int]]:
        """Requests the engine holds now (waiting, running, preparing or decoding on the side
        lane; aborted ones are gone): request id -> (steps done, total steps)."""
        with self._lock:
            return {s.request_id: (s.step, s.total_steps) for s in self.scheduler.live()}

    def hold_s(self) -> float:
        """Seconds until held requests start (request_batch_max_wait_ms); 0: step now."""
        with self._lock:
            return self.scheduler.hold_s()

    def progress(self, request_id: str) -> tuple[int, int]:
        """(steps done, total steps) of a request the engine knows; KeyError otherwise."""
        with self._lock:
            state = self.scheduler.find(request_id)
            if state is not None:
                self._progress[request_id] = (state.step, state.total_steps)
            return self._progress[request_id]

    def take_previews(self) -> dict[str, tuple[int, list]]:
        """Streaming previews decoded since the last call: request id -> (partial image index,
        PIL images); the caller sends them on. A request aborted meanwhile is dropped."""
        with self._lock:
            previews, self._previews = self._previews, {}
        return previews

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[GenerationOutput]:
        batch = self._schedule()
        if not batch and self.side_lane is not None and self.side_lane.busy:
            # Everything admitted is on the side lane: wait for it rather than spin.
            self.side_lane.wait(SIDE_LANE_WAIT_S)
            batch = self._schedule()
        # Requests whose adapters failed to load at admission fail without running.
        admitted = [*batch.prefill, *batch.prepare_aside]
        failed = {s.request_id: f"lora: {s.lora_error}" for s in admitted if s.lora_error}
        run = batch
        if failed:
            run = dataclasses.replace(
                batch,
                prefill=[s for s in batch.prefill if s.request_id not in failed],
                prepare_aside=[s for s in batch.prepare_aside if s.request_id not in failed],
                denoise=[s for s in batch.denoise if s.request_id not in failed],
            )
        out = self.runner.run(run)
        out.failed.update(failed)
        with self._lock:
            outputs = self.scheduler.update(batch, out)
            self._note_progress(batch, out, outputs)
            if self.lora is not None:
                for o in outputs:
                    self.lora.release(o.request_id)
        return outputs

    def _schedule(self) -> ScheduledBatch:
        done = self.side_lane.collect() if self.side_lane is not None else []
        with self._lock:
            return self.scheduler.schedule(done)

    def close(self) -> None:
        """Stop the side lane's worker thread (a daemon: an engine never closed does not keep
        its process alive). Requests still held are not run further."""
        if self.side_lane is not None:
            self.side_lane.close()

    def _admit_lora(self, state: RequestState) -> bool:
        """Scheduler hook: pin the request's adapters on the device (False: no free slot yet)."""
        if not state.req.lora or self.lora is None:
            return True
        try:
            held = self.lora.acquire(state.request_id, state.req.lora)
        except LoraError as exc:
            state.lora_error = exc.message
            return True
        if held is None:
            return False
        state.lora = held
        return True

    def _note_progress(self, batch, out, outputs: list[GenerationOutput]) -> None:
        """What a step leaves for readers between steps: previews and per-request progress."""
        self._previews.update(out.previews)
        running = [*batch.prefill, *batch.prepare_aside, *batch.denoise]
        running += [batch.whole] if batch.whole else []
        for s in running:
            self._progress[s.request_id] = (s.step, s.total_steps)
        for o in outputs:
            done = o.metrics.get("steps", 0)
            self._progress[o.request_id] = (done, o.metrics.get("total_steps", done))
        # Keep progress of finished requests readable, but bounded.
        while len(self._progress) > 4096:
            self._progress.pop(next(iter(self._progress)))

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        """Run requests to completion (all validated before any starts); outputs in order."""
        for r in requests:
            self.validate(r)
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise RequestValidationError("request_id", "duplicate request ids")
        for r in requests:
            self.add_request(r)
        results: dict[str, GenerationOutput] = {}
        wanted = set(ids)
        while wanted - results.keys():
            if not self.has_unfinished():
                raise DiffusionEngineError(f"requests lost: {sorted(wanted - results.keys())}")
            held = self.hold_s()
            if held > 0:
                time.sleep(held)
            for o in self.step():
                results[o.request_id] = o
        return [results[i] for i in ids]


def _check_inputs(adapter: DiffusionAdapter, req: GenerationRequest) -> None:
    """Edits: the source images and mask this family takes (the API server checked the uploads)."""
    count, most = len(req.input_images), adapter.max_input_images
    if count > most:
        what = "takes no source image" if most == 0 else f"takes at most {most} source image(s)"
        raise RequestValidationError("image", f"this pipeline {what}, got {count}")
    if count == 0 and adapter.requires_input_image:
        raise RequestValidationError("image", "this pipeline edits images: send one")
    if req.mask is not None and not adapter.accepts_mask:
        raise RequestValidationError("mask", "this pipeline does not inpaint with a mask")


def _int_field(name: str, value: Any, lo: int | None, hi: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestValidationError(name, f"must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise RequestValidationError(name, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise RequestValidationError(name, f"must be <= {hi}, got {value}")
    return value
