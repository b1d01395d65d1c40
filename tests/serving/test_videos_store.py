"""The /v1/videos job store on its own (no server): what survives a reopen, what is failed on
open, and the size and age bounds."""

from __future__ import annotations

import os
import time

import pytest

from vllm_omni_plugin.config import ConfigError
from vllm_omni_plugin.serving.videos_store import StoreError, VideoStore

REQUEST = {"prompt": "a red cat", "width": 32, "height": 32, "num_frames": 9}


def store(tmp_path, max_bytes=10_000, max_age_s=3600.0) -> VideoStore:
    return VideoStore(str(tmp_path / "store"), max_bytes, max_age_s)


def test_reopen_keeps_finished_jobs_and_fails_unfinished(tmp_path):
    s = store(tmp_path)
    s.create("video_done", REQUEST)
    s.complete("video_done", b"mp4-bytes")
    s.create("video_running", REQUEST)
    s.set_progress("video_running", 40)
    s.create("video_queued", REQUEST)
    s.close()

    again = store(tmp_path)
    assert sorted(again.fail_unfinished("restarted")) == ["video_queued", "video_running"]
    done = again.get("video_done")
    assert done["status"] == "completed" and done["progress"] == 100
    assert again.content_path("video_done").read_bytes() == b"mp4-bytes"
    assert done["expires_at"] == done["completed_at"] + 3600
    left = again.get("video_running")
    assert left["status"] == "failed" and left["progress"] == 40
    assert left["error"] == {"code": "server_restarted", "message": "restarted"}
    assert again.get("video_queued")["request"] == REQUEST


def test_list_pages_by_creation_order(tmp_path):
    s = store(tmp_path)
    for i in range(5):
        s.create(f"video_{i}", REQUEST)
    first, more = s.list(None, 2, "asc")
    assert [j["id"] for j in first] == ["video_0", "video_1"] and more
    rest, more = s.list("video_1", 10, "asc")
    assert [j["id"] for j in rest] == ["video_2", "video_3", "video_4"] and not more
    newest, _ = s.list(None, 1, "desc")
    assert newest[0]["id"] == "video_4"


def test_size_bound_deletes_the_oldest_finished_first(tmp_path):
    s = store(tmp_path, max_bytes=250)
    for i in range(3):
        s.create(f"video_{i}", REQUEST)
    s.create("video_running", REQUEST)
    for i in range(3):
        s.complete(f"video_{i}", bytes(100))
    # 300 bytes > 250: the oldest finished job went, with its file; a running job never does.
    assert s.get("video_0") is None and not s.content_path("video_0").exists()
    assert s.get("video_1") and s.get("video_2") and s.get("video_running")


def test_age_bound_expires_finished_jobs(tmp_path):
    s = store(tmp_path, max_age_s=60)
    s.create("video_old", REQUEST)
    s.complete("video_old", b"x")
    s.create("video_failed", REQUEST)
    s.fail("video_failed", "stage_error", "boom")
    s.create("video_queued", REQUEST)
    assert s.prune(now=time.time() + 30) == []
    assert s.prune(now=time.time() + 61) == ["video_failed", "video_old"]
    assert s.get("video_queued")["status"] == "queued"


def test_complete_after_delete_leaves_no_file(tmp_path):
    s = store(tmp_path)
    s.create("video_gone", REQUEST)
    assert s.delete("video_gone")
    s.complete("video_gone", b"late")
    assert s.get("video_gone") is None and not s.content_path("video_gone").exists()


@pytest.mark.parametrize(
    ("section", "field"),
    [("{max_store_bytes: 0}", "max_store_bytes"), ("{store: /tmp}", "store"), ("[1]", "videos")],
)
def test_bad_videos_section_fails_at_load_naming_the_field(tmp_path, section, field):
    from vllm_omni_plugin.config import load_deploy_config

    path = tmp_path / "wan.yaml"
    path.write_text(f"pipeline: wan\nvideos: {section}\nstages:\n  - stage_id: 0\n")
    with pytest.raises(ConfigError) as exc:
        load_deploy_config(path)
    assert field in str(exc.value)


def mode(path) -> int:
    return path.stat().st_mode & 0o777


def test_store_is_private_to_this_user(tmp_path):
    s = store(tmp_path)
    s.create("video_a", REQUEST)
    s.complete("video_a", b"mp4")
    assert mode(s.root) == 0o700 and mode(s.files) == 0o700
    assert mode(s.content_path("video_a")) == 0o600
    for db in s.root.glob("jobs.sqlite3*"):
        assert mode(db) == 0o600, db


def test_a_loose_existing_store_is_tightened(tmp_path):
    root = tmp_path / "store"
    (root / "files").mkdir(parents=True, mode=0o777)
    root.chmod(0o755)
    (root / "files").chmod(0o777)
    s = store(tmp_path)
    assert mode(s.root) == 0o700 and mode(s.files) == 0o700


def test_a_linked_store_or_files_folder_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "store").symlink_to(elsewhere)
    with pytest.raises(StoreError, match="link"):
        store(tmp_path)
    root = tmp_path / "store2"
    root.mkdir()
    (root / "files").symlink_to(elsewhere)
    with pytest.raises(StoreError, match="link"):
        VideoStore(str(root), 10_000, 3600.0)
    assert list(elsewhere.iterdir()) == []  # nothing was written through the links


def test_a_linked_partial_file_is_not_followed(tmp_path):
    s = store(tmp_path)
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    s.create("video_a", REQUEST)
    s.content_path("video_a").with_suffix(".part").symlink_to(target)
    s.complete("video_a", b"mp4")  # the stale link is removed, never written through
    assert target.read_bytes() == b"keep"
    assert s.content_path("video_a").read_bytes() == b"mp4"


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder of another user needs root")
def test_a_store_owned_by_another_user_is_refused(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    os.chown(root, 65534, 65534)
    with pytest.raises(StoreError, match="owned by uid 65534"):
        store(tmp_path)


def test_partial_files_are_removed_on_open(tmp_path):
    s = store(tmp_path)
    leftover = s.files / "video_crashed.part"
    leftover.write_bytes(b"half")
    s.close()
    store(tmp_path)
    assert not leftover.exists()


def test_an_expired_job_is_never_served(tmp_path):
    s = store(tmp_path, max_age_s=60)
    s.create("video_a", REQUEST)
    s.complete("video_a", b"mp4")
    done = s.get("video_a")
    assert s.get("video_a", now=done["expires_at"] - 1) is not None
    assert s.get("video_a", now=done["expires_at"]) is None  # read after expiry: deleted
    assert not s.content_path("video_a").exists()
    assert s.get("video_a") is None


def test_list_shows_only_the_owners_jobs(tmp_path):
    s = store(tmp_path)
    s.create("video_a", REQUEST, owner="alice")
    s.create("video_b", REQUEST, owner="bob")
    s.create("video_c", REQUEST, owner="alice")
    assert [j["id"] for j in s.list(None, 10, "asc", owner="alice")[0]] == ["video_a", "video_c"]
    assert [j["id"] for j in s.list(None, 10, "asc", owner="bob")[0]] == ["video_b"]
    assert len(s.list(None, 10, "asc")[0]) == 3  # a server without keys: no owners
