"""The host's shared secrets (node link key, Ray token) live in a folder only this user can
enter; the folder checks are the video store's (common/private_dir.py)."""

from __future__ import annotations

import os
import stat

import pytest

from vllm_omni_plugin.orchestrator.private_files import (
    PrivateFileError,
    private_dir,
    shared_secret,
)


def test_secret_folder_is_0700_and_one_secret_is_shared(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "vllm-omni").mkdir(mode=0o755)  # looser than it must be: tightened
    first, path = shared_secret("key")
    again, _ = shared_secret("key")
    assert first == again and len(first) == 64
    assert path.parent == tmp_path / "vllm-omni"
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_linked_secret_folder_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "vllm-omni").symlink_to(elsewhere)
    with pytest.raises(PrivateFileError, match="link"):
        private_dir()
    assert list(elsewhere.iterdir()) == []
