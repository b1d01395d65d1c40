"""A tokenizer folder in which vLLM finds a model config at once.

vLLM's `get_tokenizer` first parses the tokenizer folder's config.json, and from 0.27 on a failed
parse is retried once after 2 s (`transformers_utils/repo_utils.with_retry`), in every process
that loads the tokenizer (the stage, its engine core, its worker). GLM-Image's tokenizer is the
checkpoint's processor/ folder, which has no config.json: 2 s lost per process, and an error
logged, at every start. The AR stage hands vLLM instead a folder of links to the tokenizer
folder's entries plus config.json -> the AR model's own config.json: the same tokenizer files,
chat template and processor settings, and a config that parses at once (transformers then picks
the tokenizer class that tokenizer_config.json names, as without it).

The folder lives under the user's private runtime folder (`common.private_dir.user_runtime_dir`)
and is named by a digest of its links, so every start with the same folders reuses it and none
needs removing; it is built under a temporary name and renamed, so a concurrent start never sees
half of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

from ..common.private_dir import NotPrivateError, make_private_dir, user_runtime_dir

logger = logging.getLogger("vllm_omni_plugin.stages.tokenizer_folder")

CONFIG = "config.json"
SUBDIR = "tokenizers"


def with_model_config(tokenizer: str | None, model: str | None) -> str | None:
    """The folder to pass vLLM as `tokenizer`: `tokenizer` itself unless it is a local folder
    without config.json and `model` a local folder with one; else the folder of links. Falls
    back to `tokenizer` (with a warning) when the links cannot be made."""
    if not tokenizer or not model:
        return tokenizer
    tok = Path(tokenizer).absolute()
    config = Path(model).absolute() / CONFIG
    if not tok.is_dir() or (tok / CONFIG).exists() or not config.is_file():
        return tokenizer
    links = {entry.name: str(tok / entry.name) for entry in os.scandir(tok)}
    links[CONFIG] = str(config)
    digest = hashlib.sha256(json.dumps(links, sort_keys=True).encode()).hexdigest()[:24]
    try:
        root = user_runtime_dir() / SUBDIR
        make_private_dir(root)
        folder = root / digest
        if not _holds(folder, links):
            _build(root, folder, links)
    except (OSError, NotPrivateError) as exc:
        logger.warning("tokenizer %s passed to vLLM as is: %s", tokenizer, exc)
        return tokenizer
    return str(folder)


def _holds(folder: Path, links: dict[str, str]) -> bool:
    """Whether `folder` exists as this user's private folder holding exactly `links`; False if
    it does not exist, OSError if it is something else."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise OSError(f"{folder} is not a private folder of this user")
    found = {entry.name: os.readlink(entry.path) for entry in os.scandir(folder)}
    if found != links:
        raise OSError(f"{folder} holds other links than expected")
    return True


def _build(root: Path, folder: Path, links: dict[str, str]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))  # mode 0700
    try:
        for name, target in links.items():
            os.symlink(target, tmp / name)
        try:
            os.rename(tmp, folder)
        except OSError:
            # Another start made the same folder first: use it.
            if not _holds(folder, links):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)  # links only; their targets stay
