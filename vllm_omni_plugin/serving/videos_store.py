"""The /v1/videos job store: job rows in SQLite, finished MP4s as files, both under one folder.

A server restart reopens the same folder (`videos.store_dir`), so finished jobs and their
content survive it; jobs that were queued or running when the server stopped are marked failed
on open (they do not resume: their stage work died with the server). Disk is bounded: finished
jobs expire `videos.max_age_s` after completion, and past `videos.max_store_bytes` the oldest
finished jobs are deleted first. File names are job ids the server made, never user input.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    created_at INTEGER NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    completed_at INTEGER,
    expires_at INTEGER,
    error TEXT,
    bytes INTEGER NOT NULL DEFAULT 0,
    request TEXT NOT NULL
)
"""
UNFINISHED = ("queued", "in_progress")
FINISHED = ("completed", "failed")


def default_store_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-omni-videos"


class VideoStore:
    """Thread-safe (one connection behind a lock; every call is a short transaction)."""

    def __init__(self, store_dir: str | None, max_store_bytes: int, max_age_s: float) -> None:
        self.root = Path(store_dir) if store_dir else default_store_dir()
        self.files = self.root / "files"
        self.files.mkdir(parents=True, exist_ok=True)
        self.max_store_bytes = max_store_bytes
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            self.root / "jobs.sqlite3", check_same_thread=False, isolation_level=None
        )
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(_SCHEMA)

    # ---- jobs --------------------------------------------------------------------------
    def create(self, job_id: str, request: dict[str, Any]) -> dict[str, Any]:
        now = int(time.time())
        with self._lock:
            self._db.execute(
                "INSERT INTO jobs (id, created_at, status, request) VALUES (?, ?, 'queued', ?)",
                (job_id, now, json.dumps(request)),
            )
        return self.get(job_id)  # type: ignore[return-value]

    def get(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else _job(row)

    def list(self, after: str | None, limit: int, order: str) -> tuple[list[dict], bool]:
        """Jobs by creation, `order` "asc" or "desc", after the job `after`; (jobs, has_more)."""
        op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        args: list[Any] = []
        where = ""
        with self._lock:
            if after is not None:
                row = self._db.execute("SELECT seq FROM jobs WHERE id = ?", (after,)).fetchone()
                if row is None:
                    return [], False
                where = f"WHERE seq {op} ?"
                args.append(row["seq"])
            rows = self._db.execute(
                f"SELECT * FROM jobs {where} ORDER BY seq {direction} LIMIT ?", (*args, limit + 1)
            ).fetchall()
        return [_job(r) for r in rows[:limit]], len(rows) > limit

    def set_progress(self, job_id: str, progress: int) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE jobs SET status = 'in_progress', progress = MAX(progress, ?) "
                "WHERE id = ? AND status IN ('queued', 'in_progress')",
                (int(progress), job_id),
            )

    def fail(self, job_id: str, code: str, message: str) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE jobs SET status = 'failed', completed_at = ?, error = ? "
                "WHERE id = ? AND status IN ('queued', 'in_progress')",
                (int(time.time()), json.dumps({"code": code, "message": message}), job_id),
            )

    def complete(self, job_id: str, content: bytes) -> None:
        """Write the MP4 (atomically: a crash leaves no half file under its name), then the row."""
        path = self.content_path(job_id)
        tmp = path.with_suffix(".part")
        tmp.write_bytes(content)
        os.replace(tmp, path)
        now = int(time.time())
        with self._lock:
            cur = self._db.execute(
                "UPDATE jobs SET status = 'completed', progress = 100, completed_at = ?, "
                "expires_at = ?, bytes = ? WHERE id = ? AND status IN ('queued', 'in_progress')",
                (now, now + int(self.max_age_s), len(content), job_id),
            )
        if cur.rowcount == 0:  # deleted while it ran
            path.unlink(missing_ok=True)
        self.prune()

    def delete(self, job_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
        self.content_path(job_id).unlink(missing_ok=True)
        return cur.rowcount > 0

    def content_path(self, job_id: str) -> Path:
        return self.files / f"{job_id}.mp4"

    # ---- lifecycle and bounds ----------------------------------------------------------
    def fail_unfinished(self, message: str) -> list[str]:
        """On open: jobs a previous server left queued or running fail (no stage holds them)."""
        with self._lock:
            ids = [
                r["id"]
                for r in self._db.execute(
                    "SELECT id FROM jobs WHERE status IN ('queued', 'in_progress')"
                ).fetchall()
            ]
        for job_id in ids:
            self.fail(job_id, "server_restarted", message)
        return ids

    def prune(self, now: float | None = None) -> list[str]:
        """Delete expired finished jobs, then the oldest finished ones while the files exceed
        max_store_bytes. Returns the deleted ids."""
        now = int(time.time() if now is None else now)
        with self._lock:
            expired = [
                r["id"]
                for r in self._db.execute(
                    "SELECT id FROM jobs WHERE status IN ('completed', 'failed') AND "
                    "COALESCE(expires_at, completed_at + ?) <= ?",
                    (int(self.max_age_s), now),
                ).fetchall()
            ]
            total = self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM jobs").fetchone()[0]
            oldest = self._db.execute(
                "SELECT id, bytes FROM jobs WHERE status = 'completed' ORDER BY completed_at, seq"
            ).fetchall()
        gone = set(expired)
        total -= sum(r["bytes"] for r in oldest if r["id"] in gone)
        for r in oldest:
            if total <= self.max_store_bytes:
                break
            if r["id"] not in gone:
                gone.add(r["id"])
                total -= r["bytes"]
        for job_id in gone:
            self.delete(job_id)
        return sorted(gone)

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _job(row: sqlite3.Row) -> dict[str, Any]:
    out = dict(row)
    out.pop("seq", None)
    out["request"] = json.loads(out["request"])
    out["error"] = json.loads(out["error"]) if out["error"] else None
    return out
