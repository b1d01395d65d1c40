"""Secrets this user's processes share on one host: a folder and files only the user can read.

The folder is `vllm-omni` under the user's runtime folder ($XDG_RUNTIME_DIR) or, without one,
the cache folder ($XDG_CACHE_HOME or ~/.cache): mode 0700, refused when it is a link or another
user's. Its files are 0600, created without following links and atomically (a reader never sees
a half-written secret), and read only when they are regular files of this user that nobody
else can read.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from ..common.private_dir import NotPrivateError, user_runtime_dir


class PrivateFileError(RuntimeError):
    """A secret's folder or file is not private to this user (the message says why)."""


def private_dir() -> Path:
    try:
        return user_runtime_dir()
    except NotPrivateError as exc:
        raise PrivateFileError(str(exc)) from None


def read_secret(path: Path) -> str:
    """The text of `path`, refused unless it is a regular file of this user, mode 0600 or
    stricter, reached without a link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "r") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PrivateFileError(f"{path} is not a regular file of this user")
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise PrivateFileError(f"{path} is readable by others (mode {st.st_mode & 0o777:o})")
        return f.read().strip()


def shared_secret(name: str, nbytes: int = 32) -> tuple[str, Path]:
    """(secret, its file): `name` in private_dir(), created with `nbytes` random bytes (hex) by
    whichever process of this user asks first; the others read the same one."""
    path = private_dir() / name
    try:
        return read_secret(path), path
    except FileNotFoundError:
        pass
    tmp = path.with_name(f".{name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(nbytes))
        try:
            os.link(tmp, path)  # atomic, and never replaces one another process made first
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)
    return read_secret(path), path
