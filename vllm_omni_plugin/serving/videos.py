"""/v1/videos jobs: validate a request, keep it in the store, run it through the stages.

Every check happens in the API server before a job exists (OpenAI-shaped 4xx). A job then waits
in a queue; at most `videos.max_running_jobs` run at once (default: the diffusion stage's
max_batch_size, so they share denoising steps). A job that waits while a stage restarts starts
once the pipeline is healthy again; a job that was inside a stage that died fails with that
error (it is not retried). `progress` is the job's denoising steps of (steps + 1): the decode
and MP4 encoding are the last unit, so 100 means the file is stored.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import uuid
from typing import Any

from ..common.messages import GenerationParams, Progress
from ..orchestrator import StageRequestError, StageUnavailableError
from . import cache_field
from .errors import APIError, invalid
from .validation import json_object
from .videos_store import VideoStore

logger = logging.getLogger("vllm_omni_plugin.serving.videos")

_SIZE_RE = re.compile(r"^([0-9]{1,5})x([0-9]{1,5})$")
_ID_RE = re.compile(r"^video_[0-9a-f]{32}$")
MAX_SECONDS = 60
MAX_LIST_LIMIT = 100
_INT_FIELDS = ("seconds", "seed", "num_inference_steps", "fps", "num_frames")
_ALLOWED = {
    "prompt",
    "model",
    "seconds",
    "size",
    "input_reference",
    "seed",
    "num_inference_steps",
    "guidance_scale",
    "negative_prompt",
    "fps",
    "num_frames",
    "user",
    "cache",
}


class VideoService:
    def __init__(
        self,
        orchestrator: Any,
        jobs_cfg: Any,  # config VideoJobs
        serving: Any,  # config ServingLimits
        served_names: list[str],
        max_batch_size: int,
    ) -> None:
        self.orchestrator = orchestrator
        self.cfg = jobs_cfg
        self.serving = serving
        self.served_names = served_names
        self.store = VideoStore(jobs_cfg.store_dir, jobs_cfg.max_store_bytes, jobs_cfg.max_age_s)
        failed = self.store.fail_unfinished(
            "the server stopped before this job finished; unfinished jobs do not resume"
        )
        if failed:
            logger.warning(
                "%d unfinished video job(s) from a previous run marked failed", len(failed)
            )
        self.store.prune()
        self.max_running = jobs_cfg.max_running_jobs or max_batch_size
        self.default_fps = jobs_cfg.default_fps
        self.max_num_frames = jobs_cfg.max_num_frames
        self._queue: asyncio.Queue[str] | None = None
        self._workers: list[asyncio.Task] = []
        self._running: dict[str, asyncio.Task] = {}
        self._seen_facts: tuple[Any, dict[str, int]] | None = None

    # ---- requests ----------------------------------------------------------------------
    def _facts(self) -> tuple[Any, dict[str, int]]:
        info = self.orchestrator.final_info()
        if info is not None and info.video is not None:
            self._seen_facts = (
                info.limits,
                {
                    "frame_step": info.video.frame_step,
                    "default_num_frames": info.video.default_num_frames,
                },
            )
        # A restarting stage has no info yet; its bounds are the ones it announced before.
        if self._seen_facts is not None:
            return self._seen_facts
        if not self.orchestrator.healthy():
            raise APIError(
                503, "the video stage is starting; retry shortly", code="stage_unavailable"
            )
        if info is None or info.video is None or info.limits is None:
            raise APIError(
                400,
                "this pipeline does not generate videos; /v1/videos needs a video model "
                "(e.g. stage_configs/wan2_2.yaml)",
                code="unsupported_endpoint",
            )
        raise AssertionError("unreachable: announced video facts are remembered above")

    def check(self, data: dict[str, Any]) -> dict[str, Any]:
        """The job's request, every field checked and filled; APIError (4xx) otherwise."""
        limits, facts = self._facts()
        data = cache_field.fold_form(data)
        unknown = sorted(set(data) - _ALLOWED)
        if unknown:
            raise invalid(f"unknown parameter '{unknown[0]}'", unknown[0], "unknown_parameter")
        if data.get("input_reference") not in (None, ""):
            raise invalid(
                "input_reference (image-to-video) is not supported yet", "input_reference"
            )
        prompt = data.get("prompt")
        if not isinstance(prompt, str):
            raise invalid(
                "missing required parameter 'prompt'", "prompt", "missing_required_parameter"
            )
        if not prompt.strip():
            raise invalid("prompt must not be empty", "prompt")
        if len(prompt) > self.serving.max_prompt_chars:
            raise invalid(
                f"prompt has {len(prompt)} characters; the limit is "
                f"{self.serving.max_prompt_chars}",
                "prompt",
                "string_above_max_length",
            )
        negative = data.get("negative_prompt")
        if negative is not None and (
            not isinstance(negative, str) or len(negative) > self.serving.max_negative_prompt_chars
        ):
            raise invalid(
                "negative_prompt must be a string within the length limit", "negative_prompt"
            )
        model = data.get("model")
        if model is not None and model not in self.served_names:
            raise APIError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )
        ints = {k: _int(k, data.get(k)) for k in _INT_FIELDS}
        width, height = _size(data.get("size"), limits)
        fps = ints["fps"] if ints["fps"] is not None else self.default_fps
        if not 1 <= fps <= 120:
            raise invalid(f"fps must be between 1 and 120, got {fps}", "fps")
        step = int(facts["frame_step"])
        frames = ints["num_frames"]
        seconds = ints["seconds"]
        if seconds is not None and not 1 <= seconds <= MAX_SECONDS:
            raise invalid(f"seconds must be between 1 and {MAX_SECONDS}, got {seconds}", "seconds")
        if frames is None:
            # OpenAI's `seconds` (default 4): seconds x fps frames after the first, rounded
            # down to what the VAE's temporal compression allows.
            frames = (seconds or 4) * fps // step * step + 1
            if frames > self.max_num_frames:
                raise invalid(
                    f"{seconds or 4} s at {fps} fps is {frames} frames; the limit is "
                    f"{self.max_num_frames} (videos.max_num_frames)",
                    "seconds",
                )
        elif not 1 <= frames <= self.max_num_frames:
            raise invalid(
                f"num_frames must be between 1 and {self.max_num_frames}, got {frames}",
                "num_frames",
            )
        elif (frames - 1) % step:
            raise invalid(
                f"num_frames must be 1 + a multiple of {step}, got {frames}", "num_frames"
            )
        steps = ints["num_inference_steps"]
        if steps is not None and not 1 <= steps <= limits.max_steps:
            raise invalid(
                f"num_inference_steps must be between 1 and {limits.max_steps}, got {steps}",
                "num_inference_steps",
            )
        guidance = _float("guidance_scale", data.get("guidance_scale"))
        if guidance is not None and not 0 <= guidance <= 100:
            raise invalid("guidance_scale must be a finite number in [0, 100]", "guidance_scale")
        seed = ints["seed"]
        if seed is not None and not 0 <= seed <= limits.max_seed:
            raise invalid(f"seed must be an integer in [0, {limits.max_seed}]", "seed")
        return {
            "prompt": prompt,
            "negative_prompt": negative,
            "model": model or self.served_names[0],
            "width": width,
            "height": height,
            "num_frames": frames,
            "fps": fps,
            "seconds": str(seconds) if seconds is not None else _seconds(frames, fps),
            "num_inference_steps": steps,
            "guidance_scale": guidance,
            "seed": seed,
            "cache": cache_field.checked(data.get("cache")),
        }

    def create(self, data: dict[str, Any]) -> dict[str, Any]:
        request = self.check(data)
        job_id = f"video_{uuid.uuid4().hex}"
        job = self.store.create(job_id, request)
        self._ensure_workers()
        assert self._queue is not None
        self._queue.put_nowait(job_id)
        return video_object(job)

    def get(self, job_id: str) -> dict[str, Any]:
        return video_object(self._job(job_id))

    def list(self, after: str | None, limit: int, order: str) -> dict[str, Any]:
        if order not in ("asc", "desc"):
            raise invalid("order must be 'asc' or 'desc'", "order")
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise invalid(f"limit must be between 1 and {MAX_LIST_LIMIT}", "limit")
        self.store.prune()
        jobs, more = self.store.list(after, limit, order)
        data = [video_object(j) for j in jobs]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }

    def content_path(self, job_id: str, variant: str | None):
        job = self._job(job_id)
        if variant not in (None, "video"):
            raise invalid(f"variant {variant!r} is not available; only 'video'", "variant")
        path = self.store.content_path(job["id"])
        if job["status"] != "completed" or not path.is_file():
            raise APIError(
                404 if job["status"] == "failed" else 409,
                f"video {job_id} has no content (status: {job['status']})",
                param="video_id",
                code="video_not_ready" if job["status"] != "failed" else "video_failed",
            )
        return path

    def delete(self, job_id: str) -> dict[str, Any]:
        job = self._job(job_id)
        task = self._running.pop(job["id"], None)
        if task is not None:
            task.cancel()  # aborts it in the stage that holds it
        self.store.delete(job["id"])
        return {"id": job["id"], "object": "video.deleted", "deleted": True}

    def _job(self, job_id: str) -> dict[str, Any]:
        job = self.store.get(job_id) if _ID_RE.match(job_id) else None
        if job is None:
            raise APIError(
                404, f"video {job_id!r} not found", param="video_id", code="video_not_found"
            )
        return job

    # ---- running jobs ------------------------------------------------------------------
    def _ensure_workers(self) -> None:
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._workers = [asyncio.ensure_future(self._worker()) for _ in range(self.max_running)]

    async def _worker(self) -> None:
        assert self._queue is not None
        while True:
            job_id = await self._queue.get()
            job = self.store.get(job_id)
            if job is None or job["status"] != "queued":
                continue  # deleted while queued
            # A stage that is restarting takes no work; queued jobs wait for it.
            while not self.orchestrator.healthy():
                await asyncio.sleep(0.2)
            task = asyncio.ensure_future(self._run(job_id, job["request"]))
            self._running[job_id] = task
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise
            finally:
                self._running.pop(job_id, None)

    async def _run(self, job_id: str, req: dict[str, Any]) -> None:
        params = GenerationParams(
            prompt=req["prompt"],
            negative_prompt=req["negative_prompt"],
            n=1,
            height=req["height"],
            width=req["width"],
            num_inference_steps=req["num_inference_steps"],
            guidance_scale=req["guidance_scale"],
            seed=req["seed"],
            output_format="mp4",
            stream=True,  # the stages send Progress messages: the job's `progress`
            num_frames=req["num_frames"],
            fps=req["fps"],
            cache=req.get("cache"),
        )
        self.store.set_progress(job_id, 0)

        def on_progress(p: Progress) -> None:
            if p.stage == "diffusion" and p.total_steps > 0:
                self.store.set_progress(job_id, 100 * p.step // (p.total_steps + 1))

        try:
            result = await self.orchestrator.generate(job_id, params, on_progress=on_progress)
            if not result.images:
                raise StageRequestError(-1, "the stage returned no video", None)
            await asyncio.to_thread(self.store.complete, job_id, result.images[0])
        except asyncio.CancelledError:
            raise
        except StageUnavailableError as exc:
            logger.warning("video job %s failed: %s", job_id, exc)
            self.store.fail(job_id, "stage_unavailable", str(exc))
        except StageRequestError as exc:
            logger.warning("video job %s failed: %s", job_id, exc)
            self.store.fail(job_id, "invalid_request" if exc.field else "stage_error", str(exc))
        except Exception as exc:
            logger.exception("video job %s failed", job_id)
            self.store.fail(job_id, "server_error", f"{type(exc).__name__}: {exc}")

    async def aclose(self) -> None:
        for task in [*self._running.values(), *self._workers]:
            task.cancel()


def video_object(job: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's Video object (plus our request extensions, which its clients ignore)."""
    req = job["request"]
    return {
        "id": job["id"],
        "object": "video",
        "model": req["model"],
        "status": job["status"],
        "progress": int(job["progress"]),
        "created_at": job["created_at"],
        "completed_at": job["completed_at"],
        "expires_at": job["expires_at"],
        "error": job["error"],
        "prompt": req["prompt"],
        "seconds": req["seconds"],
        "size": f"{req['width']}x{req['height']}",
        "remixed_from_video_id": None,
        "num_frames": req["num_frames"],
        "fps": req["fps"],
        "seed": req["seed"],
    }


def parse_create_body(body: bytes, content_type: str, form: dict[str, Any] | None) -> dict:
    """JSON, or the multipart form the official client sends (its values arrive as strings)."""
    if form is not None:
        for key, value in form.items():
            if hasattr(value, "read"):  # an uploaded file: only input_reference would be one
                raise invalid(
                    f"file uploads ({key}) are not supported yet: image-to-video is not served",
                    key,
                    "unsupported_parameter",
                )
        return dict(form)
    return json_object(body)


def _int(name: str, value: Any) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,20}", value.strip()):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"invalid type for '{name}': expected an integer", name, "invalid_type")
    return value


def _float(name: str, value: Any) -> float | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise invalid(
                f"invalid type for '{name}': expected a number", name, "invalid_type"
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(f"invalid type for '{name}': expected a number", name, "invalid_type")
    return float(value)


def _size(size: Any, limits: Any) -> tuple[int, int]:
    if size is None or size == "":
        return limits.default_width, limits.default_height
    match = _SIZE_RE.match(size) if isinstance(size, str) else None
    if match is None:
        raise invalid(f"size must look like 'WIDTHxHEIGHT' (e.g. '832x480'), got {size!r}", "size")
    width, height = int(match.group(1)), int(match.group(2))
    g = limits.granularity
    for name, value, low, top in (
        ("width", width, limits.min_width, limits.max_width),
        ("height", height, limits.min_height, limits.max_height),
    ):
        if not low <= value <= top or value % g:
            raise invalid(
                f"unsupported size {size}: {name} must be a multiple of {g} in [{low}, {top}]",
                "size",
            )
    return width, height


def _seconds(frames: int, fps: int) -> str:
    return f"{(frames - 1) / fps:g}"


def init_video_service(client: Any, state: Any, args: Any) -> None:
    """Called by the endpoint plugin: the state behind /v1/videos (its store opens now, so
    jobs a previous server left unfinished are marked failed at start-up)."""
    from .app_state import served_names

    cfg = client.cfg
    if cfg.topology.stages[-1].emits != "video":
        return
    final = cfg.final_stage
    state.omni_videos = VideoService(
        client.orchestrator,
        cfg.videos,
        cfg.serving,
        served_names(client, args),
        max_batch_size=final.diffusion.max_batch_size if final.diffusion else 1,
    )
