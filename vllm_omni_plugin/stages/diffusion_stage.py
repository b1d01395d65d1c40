"""A diffusion stage process: our DiffusionEngine driven by the stage loop.

The loop (loop.SteppedStageLoop) drains new messages (requests join at step boundaries), runs
one engine step, sends what finished; it blocks on the socket only when the engine is idle. Images are
encoded here (PNG/JPEG/WEBP as each request asked), off the API server's event loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from ..common.messages import DiffusionSettings, Progress, Result, StageInfo, Submit, VideoFacts
from ..config.stage_init import StageInit
from .images import encode_image
from .loop import SteppedStageLoop
from .videos_encode import encode_mp4

logger = logging.getLogger("vllm_omni_plugin.stages.diffusion")

# Exit code of a diffusion stage taken down by a device error (EX_SOFTWARE): the orchestrator
# fails its in-flight requests (503) and starts a fresh process with a fresh device context.
DEVICE_ERROR_EXIT_CODE = 70


@dataclass
class _Job:
    received: float
    output_format: str
    compression: int | None
    stream: bool = False
    sent_step: int = -1  # the last step reported in a Progress message
    fps: int | None = None  # video jobs (output_format "mp4"): frames per second of the MP4


class DiffusionStageRunner(SteppedStageLoop):
    def __init__(self, init: StageInit, conn: Any):
        from vllm_omni_plugin.diffusion import DiffusionEngineConfig
        from vllm_omni_plugin.diffusion.parallel import build_engine

        super().__init__(init, conn)
        stage = init.stage
        config = DiffusionEngineConfig.from_owner(
            stage.diffusion,
            model=str(stage.model_path),
            defaults=stage.sampling.defaults_dict(),
            pipeline_class=init.spec.pipeline_class,
        )
        # cfg_parallel / ulysses_degree: this process is rank 0 and starts the other ranks; one
        # that dies takes this process down with it, so the stage restarts as a whole.
        self.engine = build_engine(config)
        self.jobs: dict[str, _Job] = {}

    def info(self) -> StageInfo:
        """Ready info: the bounds the API server validates against, and what this stage runs."""
        return StageInfo(
            kind="diffusion",
            pipeline_class=type(self.engine.adapter).pipeline_class,
            limits=self.engine.limits,
            memory=self.engine.memory,
            effective=self.describe(),
            # The request fields this model applies beyond the common ones, the common ones it
            # does not, and its CFG rule (the API server refuses by them before they travel).
            family=_family(self.engine.adapter),
            knobs=[k.to_dict() for k in self.engine.adapter.applied_knobs()],
            unsupported=dict(self.engine.adapter.unsupported),
            cfg=_cfg(self.engine.adapter),
            # Video families: what /v1/videos checks requests against (frames = 1 + k * step).
            video=VideoFacts(**self.engine.adapter.video_facts())
            if _is_video(self.engine)
            else None,
            # LoRA: the adapter folder and target linears the API server checks against.
            lora=_lora_facts(self.engine),
        )

    def describe(self) -> DiffusionSettings:
        """The settings in effect, read back from the live engine (not from the config)."""
        import os

        import torch

        engine = self.engine
        vae = getattr(engine.adapter.pipe, "vae", None)
        return DiffusionSettings(
            engine=msgspec.to_builtins(dataclasses.asdict(engine.config), enc_hook=str),
            device=str(engine.device),
            dtype=str(engine.dtype),
            memory_budget_bytes=engine._budget_bytes,
            scheduler_max_batch_size=engine.scheduler.max_batch_size,
            scheduler_max_wait_s=engine.scheduler.max_wait_s,
            vae_use_slicing=getattr(vae, "use_slicing", None),
            vae_use_tiling=getattr(vae, "use_tiling", None),
            torch_threads=torch.get_num_threads(),
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        )

    # ---- driving the engine (the loop is loop.SteppedStageLoop's) -------------------------
    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def hold_s(self) -> float | None:
        # Requests held for batching (request_batch_max_wait_ms): wait for more until it ends.
        return self.engine.hold_s()

    def step(self) -> None:
        outs = self._step()
        self._send_progress()
        for out in outs:
            self._finish(out)

    def held(self) -> dict[str, dict[str, int]]:
        return {r: {"step": s, "total_steps": t} for r, (s, t) in self.engine.held().items()}

    def engine_unfinished(self) -> int | None:
        return len(self.engine.held())

    def _step(self) -> list[Any]:
        from vllm_omni_plugin.diffusion.errors import DeviceError

        try:
            return self.engine.step()
        except DeviceError:
            # After a CUDA error every later step fails too while this stage still looks
            # ready: exit at once (no teardown that touches the device) and be restarted.
            logger.critical("device error; stage exits to be restarted", exc_info=True)
            self.payloads.close()
            logging.shutdown()
            os._exit(DEVICE_ERROR_EXIT_CODE)

    def _send_progress(self) -> None:
        """Streaming requests: one Progress per step a request advanced, with its preview
        images (encoded as the request asked) on the steps that decoded one."""
        previews = self.engine.take_previews()
        for rid, job in self.jobs.items():
            if not job.stream:
                continue
            try:
                step, total = self.engine.progress(rid)
            except KeyError:
                continue
            found = previews.get(rid)
            if step == job.sent_step and found is None:
                continue
            job.sent_step = step
            msg = Progress(rid, self.stage_id, "diffusion", step, total)
            if found is not None:
                index, images = found
                msg.preview_index = index
                msg.preview = [
                    encode_image(im, job.output_format, job.compression) for im in images
                ]
            self.reply(msg)

    def on_abort(self, request_id: str) -> None:
        if self.jobs.pop(request_id, None) is not None:
            self.engine.abort(request_id)

    def on_submit(self, msg: Submit) -> None:
        from vllm_omni_plugin.common.errors import RequestValidationError
        from vllm_omni_plugin.connectors import ConnectorError
        from vllm_omni_plugin.diffusion import GenerationRequest

        t0 = time.perf_counter()
        p = msg.params
        try:
            # GLM-Image: the AR stage's prior token ids. All inputs are released, read or not.
            received = self.payloads.receive_all(list(msg.inputs.values()))
            prior = received[-1] if received else None
            req = GenerationRequest(
                request_id=msg.request_id,
                prompt=p.prompt,
                negative_prompt=p.negative_prompt,
                n=p.n,
                height=p.height,
                width=p.width,
                num_inference_steps=p.num_inference_steps,
                guidance_scale=p.guidance_scale,
                seed=p.seed,
                prior_token_ids=prior,
                partial_images=p.partial_images if p.stream else 0,
                num_frames=p.num_frames,  # video requests only
                cache=p.cache,
                # Edits: the API server's checked lossless PNGs (GenerationParams' contract).
                input_images=[_decode_png(b) for b in p.input_images],
                mask=None if p.mask is None else _decode_png(p.mask),
                knobs=dict(p.knobs),
                lora=[dict(x) for x in p.lora] or None,
            )
            self.engine.add_request(req)
        except RequestValidationError as exc:
            self.reply(Result(msg.request_id, error=exc.message, error_field=exc.field))
            return
        except ConnectorError as exc:  # expected when the request was aborted meanwhile
            logger.warning("request %s: its input is gone: %s", msg.request_id, exc)
            self.reply(Result(msg.request_id, error=f"{type(exc).__name__}: {exc}"))
            return
        except Exception as exc:  # a bad payload or engine refusal fails this request only
            logger.exception("request %s rejected", msg.request_id)
            self.reply(Result(msg.request_id, error=f"{type(exc).__name__}: {exc}"))
            return
        self.jobs[msg.request_id] = _Job(t0, p.output_format, p.output_compression, p.stream)
        self.jobs[msg.request_id].fps = p.fps  # video requests only

    def _finish(self, out: Any) -> None:
        job = self.jobs.pop(out.request_id, None)
        if job is None:  # aborted while its last step ran
            return
        if out.error is not None:
            result = Result(out.request_id, error=out.error, metrics=dict(out.metrics))
        else:
            images = (
                [encode_mp4(out.images, job.fps or 16)]  # a video: its frames as one MP4
                if job.output_format == "mp4"
                else [encode_image(im, job.output_format, job.compression) for im in out.images]
            )
            result = Result(out.request_id, output=images, metrics=dict(out.metrics))
        result.stage_s = time.perf_counter() - job.received
        self.reply(result)


def _is_video(engine: Any) -> bool:
    """A video family's adapter says what its frames must look like (adapters/wan.py)."""
    return hasattr(engine.adapter, "video_facts")


def _cfg(adapter: Any) -> dict[str, Any] | None:
    facts = adapter.cfg_facts()
    return None if facts is None else facts.to_dict()


def _family(adapter: Any) -> str:
    return type(adapter).family or type(adapter).pipeline_class


def _decode_png(data: bytes) -> Any:
    """An edit's source image or mask as PIL (the API server checked and re-encoded it)."""
    import io

    from PIL import Image

    im = Image.open(io.BytesIO(data), formats=["PNG"])
    im.load()
    return im


def _lora_facts(engine: Any) -> dict[str, Any] | None:
    store = getattr(engine, "lora", None)
    return None if store is None else store.facts()
