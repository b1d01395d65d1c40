"""The `/v1/videos` job store and its request bounds (top-level `videos:` section).

Video jobs take minutes, so their state and finished files live on disk (serving/videos_store.py)
and outlive the server; these fields bound that disk and the requests that fill it.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError

from vllm_omni_plugin.config.errors import ProblemSink, did_you_mean
from vllm_omni_plugin.config.owners_common import Owner


class VideoJobs(Owner):
    """Where video jobs are kept, for how long, and what one job may ask for."""

    store_dir: str | None = None
    """Folder of the job store (SQLite database + MP4 files); None: `vllm-omni-videos` under the
    user's cache folder ($XDG_CACHE_HOME or ~/.cache). Reused across restarts."""
    max_store_bytes: int = Field(10 * 2**30, ge=1)
    """Most bytes of finished videos kept; past it the oldest finished jobs are deleted."""
    max_age_s: float = Field(24 * 3600.0, gt=0)
    """A finished job (and its file) is deleted this long after it completed (`expires_at`)."""
    max_running_jobs: int | None = Field(None, ge=1)
    """Jobs handed to the stages at once (the rest wait, queued); None: the diffusion stage's
    max_batch_size, so concurrent jobs share denoising steps."""
    max_num_frames: int = Field(241, ge=1)
    """Most frames one video may have (`num_frames`, or `seconds` x `fps` + 1)."""
    default_fps: int = Field(16, ge=1, le=120)
    """Frames per second of the MP4 when a request names none (Wan2.2 A14B: 16)."""
    max_queued_jobs: int = Field(16, ge=0, le=10_000)
    """Jobs waiting for a running slot; past it `POST /v1/videos` gets 429 with Retry-After."""
    job_timeout_s: float = Field(3600.0, gt=0)
    """A job still running after this long fails (code `job_timeout`) and its stage work stops."""
    max_event_streams: int = Field(64, ge=1, le=10_000)
    """Open `GET /v1/videos/{id}/events` streams per server; past it a new one gets 429."""


def video_jobs(raw: Any, sink: ProblemSink) -> VideoJobs:
    """The `videos:` section; problems go to `sink` naming `videos.<field>`."""
    if raw is None:
        return VideoJobs()
    if not isinstance(raw, dict):
        sink.add(None, "videos", "must be a mapping (store_dir, max_store_bytes, ...)")
        return VideoJobs()
    try:
        return VideoJobs(**raw)
    except ValidationError as exc:
        for err in exc.errors():
            key = ".".join(map(str, err["loc"]))
            msg = (
                "unknown key" + did_you_mean(key, VideoJobs.model_fields)
                if err["type"] == "extra_forbidden"
                else err["msg"]
            )
            sink.add(None, f"videos.{key}", msg)
        return VideoJobs()
