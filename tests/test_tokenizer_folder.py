"""The AR stage's tokenizer folder for vLLM (stages/tokenizer_folder.py): links to the tokenizer
folder's entries plus the model's config.json, private to the user and reused by digest."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from vllm_omni_plugin.stages.tokenizer_folder import with_model_config


@pytest.fixture
def folders(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    proc, model = tmp_path / "ckpt" / "processor", tmp_path / "ckpt" / "vision_language_encoder"
    proc.mkdir(parents=True)
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (proc / name).write_text(name)
    (model / "config.json").write_text('{"model_type": "glm_image"}')
    return proc, model


def test_links_to_the_tokenizer_files_plus_the_model_config(folders, tmp_path):
    proc, model = folders
    out = Path(with_model_config(str(proc), str(model)))
    assert out.parent == tmp_path / "run" / "vllm-omni" / "tokenizers"
    for folder in (out, out.parent):
        assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
    links = {p.name: os.readlink(p) for p in out.iterdir()}
    assert links == {
        **{p.name: str(p) for p in proc.iterdir()},
        "config.json": str(model / "config.json"),
    }
    assert (out / "tokenizer.json").read_text() == "tokenizer.json"
    # The same folders again: the same folder, not rebuilt; nothing else left in its parent.
    inode = os.lstat(out).st_ino
    assert with_model_config(str(proc), str(model)) == str(out)
    assert os.lstat(out).st_ino == inode and list(out.parent.iterdir()) == [out]
    # Another file in the tokenizer folder: another folder.
    (proc / "preprocessor_config.json").write_text("{}")
    other = Path(with_model_config(str(proc), str(model)))
    assert other != out and (other / "preprocessor_config.json").is_symlink()


def test_passed_as_is_when_not_needed_or_not_possible(folders):
    proc, model = folders
    assert with_model_config(None, str(model)) is None
    assert with_model_config("org/hub-id", str(model)) == "org/hub-id"
    assert with_model_config(str(proc), str(proc)) == str(proc)  # the model has no config
    (proc / "config.json").write_text("{}")
    assert with_model_config(str(proc), str(model)) == str(proc)  # vLLM finds one already


def test_a_tampered_folder_is_not_used(folders):
    proc, model = folders
    out = Path(with_model_config(str(proc), str(model)))
    (out / "tokenizer.json").unlink()
    (out / "tokenizer.json").symlink_to("/elsewhere")
    assert with_model_config(str(proc), str(model)) == str(proc)
