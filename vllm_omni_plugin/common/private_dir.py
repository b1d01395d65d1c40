"""A folder only this user can enter (mode 0700), for secrets, stored results and the files a
stage prepares for its engine."""

from __future__ import annotations

import os
from pathlib import Path


class NotPrivateError(RuntimeError):
    """The folder cannot be made private to this user (the message says why)."""


def make_private_dir(path: Path) -> None:
    """`path` as a folder only this user can enter: created if missing (its parents with the
    usual modes), its mode set to 0700, refused if it is a link, not a folder, or another
    user's. Checked through a descriptor opened without following links, so a link swapped in
    between the checks is refused too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise NotPrivateError(f"{path} is not a folder (or is a link): {exc}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise NotPrivateError(
                f"{path} is owned by uid {st.st_uid}, not this user ({os.geteuid()})"
            )
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def user_runtime_dir() -> Path:
    """`vllm-omni` under this user's runtime folder ($XDG_RUNTIME_DIR) or, without one, the cache
    folder ($XDG_CACHE_HOME or ~/.cache), made private (`make_private_dir`; NotPrivateError)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or os.environ.get("XDG_CACHE_HOME")
    path = (Path(base) if base else Path.home() / ".cache") / "vllm-omni"
    make_private_dir(path)
    return path
