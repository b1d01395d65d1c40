"""The /v1/videos job store: job rows in SQLite, finished MP4s as files, both under one folder.

A server restart reopens the same folder (`videos.store_dir`), so finished jobs and their
content survive it; jobs that were queued or running when the server stopped are marked failed
on open (they do not resume: their stage work died with the server). Disk is bounded: finished
jobs expire `videos.max_age_s` after completion, and past `videos.max_store_bytes` the oldest
finished jobs are deleted first; expiry is also checked whenever a job is read, so an expired
file is never served. File names are job ids the server made, never user input.

Other local users see nothing of it: the folders are 0700 and the files 0600, created without
following links (a folder that is a link, or one owned by another user, is refused), and the
partial files a crash can leave are removed on open. Each job records its owner (a digest of the
API key that created it, serving/owners.py) so that other keys cannot see it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import threading
import time
from pathlib import Path
from typing import Any

from ..common.private_dir import NotPrivateError, make_private_dir

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
    request TEXT NOT NULL,
    owner TEXT
)
"""
UNFINISHED = ("queued", "in_progress")
FINISHED = ("completed", "failed")


def default_store_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-omni-videos"


class StoreError(RuntimeError):
    """The store folder cannot be used safely (a link, another user's, not a folder)."""


def private_dir(path: Path) -> None:
    try:
        make_private_dir(path)
    except NotPrivateError as exc:
        raise StoreError(f"video store: {exc}; choose another videos.store_dir") from None


def private_file(path: Path, *, exclusive: bool) -> int:
    """A writable descriptor of `path`, mode 0600, never through a link (O_NOFOLLOW)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    if exclusive:
        flags |= os.O_EXCL
    fd = os.open(path, flags, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise StoreError(f"{path} is not a regular file of this user")
        if stat.S_IMODE(st.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


class VideoStore:
    """Thread-safe (one connection behind a lock; every call is a short transaction)."""

    def __init__(self, store_dir: str | None, max_store_bytes: int, max_age_s: float) -> None:
        self.root = Path(store_dir) if store_dir else default_store_dir()
        self.files = self.root / "files"
        private_dir(self.root)
        private_dir(self.files)
        for leftover in self.files.glob("*.part"):  # a write a crash interrupted
            leftover.unlink(missing_ok=True)
        self.max_store_bytes = max_store_bytes
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        db = self.root / "jobs.sqlite3"
        os.close(private_file(db, exclusive=False))  # SQLite's -wal/-shm files copy its mode
        self._db = sqlite3.connect(db, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(_SCHEMA)
            columns = {r["name"] for r in self._db.execute("PRAGMA table_info(jobs)")}
            if "owner" not in columns:  # a store from before owners: its jobs have none
                self._db.execute("ALTER TABLE jobs ADD COLUMN owner TEXT")

    # ---- jobs --------------------------------------------------------------------------
    def create(
        self, job_id: str, request: dict[str, Any], owner: str | None = None
    ) -> dict[str, Any]:
        now = int(time.time())
        with self._lock:
            self._db.execute(
                "INSERT INTO jobs (id, created_at, status, request, owner) "
                "VALUES (?, ?, 'queued', ?, ?)",
                (job_id, now, json.dumps(request), owner),
            )
        return self.get(job_id)  # type: ignore[return-value]

    def get(self, job_id: str, now: float | None = None) -> dict[str, Any] | None:
        """The job, or None: unknown, or expired (then deleted, with its file)."""
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            return None
        job = _job(row)
        if self._expired(job, time.time() if now is None else now):
            self.delete(job_id)
            return None
        return job

    def _expired(self, job: dict[str, Any], now: float) -> bool:
        if job["status"] not in FINISHED or job["completed_at"] is None:
            return False
        expires = job["expires_at"] or job["completed_at"] + int(self.max_age_s)
        return expires <= now

    def list(
        self, after: str | None, limit: int, order: str, owner: str | None = None
    ) -> tuple[list[dict], bool]:
        """Jobs by creation, `order` "asc" or "desc", after the job `after`; (jobs, has_more).
        With `owner`, only that owner's jobs."""
        op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        where = ["owner = ?"] if owner is not None else []
        args: list[Any] = [owner] if owner is not None else []
        with self._lock:
            if after is not None:
                row = self._db.execute("SELECT seq FROM jobs WHERE id = ?", (after,)).fetchone()
                if row is None:
                    return [], False
                where.append(f"seq {op} ?")
                args.append(row["seq"])
            clause = f"WHERE {' AND '.join(where)}" if where else ""
            rows = self._db.execute(
                f"SELECT * FROM jobs {clause} ORDER BY seq {direction} LIMIT ?",
                (*args, limit + 1),
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
        tmp.unlink(missing_ok=True)
        fd = private_file(tmp, exclusive=True)
        with os.fdopen(fd, "wb") as f:
            f.write(content)
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
