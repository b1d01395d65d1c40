"""/v1/videos jobs: validate a request, keep it in the store, run it through the stages.

Every check happens in the API server before a job exists (OpenAI-shaped 4xx). A job then waits
in a queue; at most `videos.max_running_jobs` run at once (default: the diffusion stage's
max_batch_size, so they share denoising steps). A job that waits while a stage restarts starts
once the pipeline is healthy again; a job that was inside a stage that died fails with that
error (it is not retried). `progress` is the job's denoising steps of (steps + 1): the decode
and MP4 encoding are the last unit, so 100 means the file is stored.

Bounded: at most `videos.max_queued_jobs` wait (a new job past it gets 429 with Retry-After), a
job running longer than `videos.job_timeout_s` fails (`job_timeout`) and its stage work is
aborted, and at most `videos.max_event_streams` progress streams are open at once. When the
server has API keys, a job is visible only to the key that created it (serving/owners.py).
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from typing import Any

from ..common.messages import GenerationParams, Progress
from ..orchestrator import StageRequestError, StageUnavailableError
from . import cache_field
from .errors import APIError, invalid
from .lora_adapters import LoraAdapters
from .owners import visible
from .request_fields import FamilyFields
from .videos_queue import JobQueue
from .videos_request import VideoBounds, check_video_request, no_reference
from .videos_store import VideoStore

logger = logging.getLogger("vllm_omni_plugin.serving.videos")

_ID_RE = re.compile(r"^video_[0-9a-f]{32}$")
MAX_LIST_LIMIT = 100


class ClientGone(Exception):
    """A /v1/videos/sync client went away; its job was cancelled."""


class VideoService:
    def __init__(
        self,
        orchestrator: Any,
        jobs_cfg: Any,  # config VideoJobs
        serving: Any,  # config ServingLimits
        served_names: list[str],
        max_batch_size: int,
        lora: LoraAdapters | None = None,
    ) -> None:
        self.orchestrator = orchestrator
        self.lora = lora or LoraAdapters(orchestrator)  # the served LoRA adapters
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
        self.job_timeout_s = jobs_cfg.job_timeout_s
        self.queue = JobQueue(jobs_cfg.max_queued_jobs, jobs_cfg.max_event_streams)
        self._workers: list[asyncio.Task] = []
        self._running: dict[str, asyncio.Task] = {}
        self._seen_facts: tuple[Any, dict[str, int]] | None = None
        self._seen_info: Any = None  # the final stage's StageInfo, once announced
        # Jobs a /v1/videos/sync request waits on -> set when the job ends (however).
        self._ended: dict[str, asyncio.Event] = {}
        # Queued or running jobs' source images (lossless PNG), until the job is sent.
        self._references: dict[str, bytes] = {}

    # ---- requests ----------------------------------------------------------------------
    def _facts(self) -> tuple[Any, dict[str, int]]:
        info = self.orchestrator.final_info()
        if info is not None and info.video is not None:
            self._seen_facts = (
                info.limits,
                {
                    "frame_step": info.video.frame_step,
                    "default_num_frames": info.video.default_num_frames,
                    "max_input_images": info.video.max_input_images,
                    "requires_input_image": info.video.requires_input_image,
                    "memory": info.memory,  # common.memory.MemoryModel or None
                },
            )
            self._seen_info = info
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
        bounds = VideoBounds(
            limits,
            facts,
            FamilyFields.from_info(self._seen_info),
            self.serving,
            self.served_names,
            self.default_fps,
            self.max_num_frames,
        )
        data = cache_field.fold_form(data)
        cache = data.pop("cache", None)
        request = check_video_request(data, bounds)
        request["cache"] = cache_field.checked(cache)
        refs = request["extensions"].get("lora")
        if refs:
            request["extensions"] = {**request["extensions"], "lora": self.lora.resolve(refs)}
        return request

    def accepts_reference(self) -> None:
        """400 unless the served model takes an `input_reference` (before the file is read)."""
        _, facts = self._facts()
        if not facts.get("max_input_images"):
            raise no_reference()

    def create(self, data: dict[str, Any], owner: str | None = None) -> dict[str, Any]:
        # (The route also asks before reading the body; other jobs may have come meanwhile.)
        self.queue.admit()
        return video_object(self._enqueue(self.check(data), owner))

    def _enqueue(self, request: dict[str, Any], owner: str | None) -> dict[str, Any]:
        job_id = f"video_{uuid.uuid4().hex}"
        # The source image stays in memory until the job runs (unfinished jobs do not outlive
        # the server; the queue bounds how many wait); the stored request says it had one.
        reference = request.pop("input_reference", None)
        request["input_reference"] = reference is not None
        job = self.store.create(job_id, request, owner)
        if reference is not None:
            self._references[job_id] = reference
        if request.get("user") is not None:
            logger.info("video job %s is for user %r", job_id, request["user"])
        self._ensure_workers()
        self.queue.put(job_id)
        return job

    async def create_sync(
        self, data: dict[str, Any], disconnected: Any, owner: str | None = None
    ) -> tuple[Any, str]:
        """POST /v1/videos/sync: a job like any other (same queue, same running bound, listed
        under /v1/videos), waited for: (its MP4 path, its id). Past `serving.request_timeout_s`
        or when the client goes away, the job is cancelled (504 / ClientGone)."""
        self.queue.admit()
        request = self.check(data)
        ended = asyncio.Event()
        job = self._enqueue(request, owner)
        job_id = job["id"]
        self._ended[job_id] = ended
        watch = asyncio.ensure_future(disconnected())
        done_wait = asyncio.ensure_future(ended.wait())
        try:
            done, _ = await asyncio.wait(
                {done_wait, watch},
                timeout=self.serving.request_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            watch.cancel()
            done_wait.cancel()
            self._ended.pop(job_id, None)
        if done_wait not in done:
            self.delete(job_id)  # cancels it in the stage that holds it
            if watch in done:
                raise ClientGone(job_id)
            raise APIError(
                504,
                f"the video did not finish within the server's limit of "
                f"{self.serving.request_timeout_s:g} s (serving.request_timeout_s); "
                "it was cancelled",
                code="request_timeout",
                type="timeout_error",
            )
        job = self._job(job_id)
        if job["status"] != "completed":
            error = job["error"] or {}
            code = error.get("code", "server_error")
            status = {"invalid_request": 400, "stage_unavailable": 503, "job_timeout": 504}
            raise APIError(
                status.get(code, 500),
                error.get("message", "the video failed"),
                code=code,
                type="timeout_error" if code == "job_timeout" else None,
            )
        return self.content_path(job_id, None), job_id

    def get(self, job_id: str, owner: str | None = None) -> dict[str, Any]:
        return video_object(self._job(job_id, owner))

    def list(
        self, after: str | None, limit: int, order: str, owner: str | None = None
    ) -> dict[str, Any]:
        if order not in ("asc", "desc"):
            raise invalid("order must be 'asc' or 'desc'", "order")
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise invalid(f"limit must be between 1 and {MAX_LIST_LIMIT}", "limit")
        self.store.prune()
        if after is not None:
            self._job(after, owner)  # another key's id pages nothing (404, as if unknown)
        jobs, more = self.store.list(after, limit, order, owner)
        data = [video_object(j) for j in jobs]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }

    def content_path(self, job_id: str, variant: str | None, owner: str | None = None):
        job = self._job(job_id, owner)  # an expired job is deleted here, never served
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

    def delete(self, job_id: str, owner: str | None = None) -> dict[str, Any]:
        job = self._job(job_id, owner)
        task = self._running.pop(job["id"], None)
        if task is not None:
            task.cancel()  # aborts it in the stage that holds it
        self.queue.discard(job["id"])
        self._references.pop(job["id"], None)
        self.store.delete(job["id"])
        self._signal_end(job["id"])
        self.queue.notify()
        return {"id": job["id"], "object": "video.deleted", "deleted": True}

    def _job(self, job_id: str, owner: str | None = None) -> dict[str, Any]:
        job = self.store.get(job_id) if _ID_RE.match(job_id) else None
        if job is None or not visible(job["owner"], owner):
            raise APIError(
                404, f"video {job_id!r} not found", param="video_id", code="video_not_found"
            )
        return job

    # ---- running jobs ------------------------------------------------------------------
    def _ensure_workers(self) -> None:
        if not self._workers:
            self._workers = [asyncio.ensure_future(self._worker()) for _ in range(self.max_running)]

    async def _worker(self) -> None:
        while True:
            job_id = await self.queue.take(self.orchestrator.healthy)
            job = self.store.get(job_id)
            if job is None or job["status"] != "queued":
                self._references.pop(job_id, None)
                continue  # deleted while it waited
            task = asyncio.ensure_future(self._run(job_id, job["request"]))
            self._running[job_id] = task
            try:
                done, _ = await asyncio.wait({task}, timeout=self.job_timeout_s)
                if not done:
                    await self._time_out(job_id, task)
                elif not task.cancelled():
                    task.result()
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise
            finally:
                self._running.pop(job_id, None)
                self._signal_end(job_id)  # after _time_out stored the failure
                self.queue.notify()

    async def _time_out(self, job_id: str, task: asyncio.Task) -> None:
        """A job past `videos.job_timeout_s`: its stage work is aborted, the job fails."""
        task.cancel()  # cancelling the orchestrator call aborts the request in its stage
        await asyncio.wait({task})
        message = (
            f"the job did not finish within the server's limit of {self.job_timeout_s:g} s "
            "(videos.job_timeout_s); it was cancelled"
        )
        logger.warning("video job %s: %s", job_id, message)
        self.store.fail(job_id, "job_timeout", message)

    async def _run(self, job_id: str, req: dict[str, Any]) -> None:
        reference = self._references.pop(job_id, None)
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
            knobs=dict(req.get("knobs") or {}),
            cache=req.get("cache"),
            lora=list((req.get("extensions") or {}).get("lora") or []),
            input_images=[] if reference is None else [reference],
        )
        self.store.set_progress(job_id, 0)
        self.queue.notify()

        def on_progress(p: Progress) -> None:
            if p.stage == "diffusion" and p.total_steps > 0:
                self.store.set_progress(job_id, 100 * p.step // (p.total_steps + 1))
                self.queue.notify()

        try:
            if req.get("input_reference") and reference is None:
                raise RuntimeError("the job's input_reference is gone")
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

    def _signal_end(self, job_id: str) -> None:
        """Wake a /v1/videos/sync request waiting on the job, once its end is stored."""
        ended = self._ended.get(job_id)
        if ended is not None:
            ended.set()

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
        # The family's knobs the job set (guidance_scale_2, boundary_ratio, flow_shift, ...).
        **req.get("knobs", {}),
    }


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
        lora=getattr(state, "omni_lora", None),
    )
