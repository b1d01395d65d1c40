"""Shared-memory connector for stages in different processes of one node.

Each put writes the payload's bytes into its own file in a tmpfs (/dev/shm): one copy on the
producer side. The consumer maps the file shared and pre-faulted, so get costs no second copy: the
tensor aliases the file's pages, which nobody else writes (the producer never touches a file after
put) and which outlive the file's name, so the tensor stays valid after release. (A private
mapping looks safer but is not free: pre-faulting a writable private mapping copies every page,
which made get cost as much as put.) Release unlinks the file (either
side may do it); the producer also unlinks on lease expiry and on close, and a new connector
removes files left behind by producers that died.
"""

from __future__ import annotations

import mmap
import os
import re
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

import torch

from vllm_omni_plugin.connectors.base import (
    ConnectorError,
    Deadline,
    PayloadDescriptor,
    StageConnector,
    new_key,
)
from vllm_omni_plugin.connectors.serialization import decode, encode

_FILE_RE = re.compile(r"^omni-shm-(\d+)-[0-9a-f]{32}$")


def _default_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShmConnector(StageConnector):
    kind = "shm"
    #: seconds between two sweeps of every lease (a put sweeps only the oldest ones)
    full_sweep_s = 1.0

    def __init__(
        self,
        name: str | None = None,
        lease_s: float = 300.0,
        shm_dir: str | None = None,
        device: str = "cpu",
    ):
        super().__init__(name, lease_s)
        self.dir = shm_dir or _default_dir()
        self.device = torch.device(device)
        self._lock = threading.Lock()
        # key -> (path, nbytes, t0, until), oldest first
        self._owned: OrderedDict[str, tuple[str, int, float, float]] = OrderedDict()
        self._full_sweep_at = 0.0
        self._closed = False
        self._remove_orphans()

    # -- producer -------------------------------------------------------------------------
    def put(
        self, request_id: str, from_stage: int, to_stage: int, payload: Any
    ) -> PayloadDescriptor:
        if self._closed:
            raise ConnectorError(f"connector {self.name!r} is closed")
        enc = encode(payload)
        key = new_key(request_id, from_stage, to_stage)
        path = os.path.join(self.dir, f"omni-shm-{os.getpid()}-{uuid.uuid4().hex}")
        try:
            self._write(path, enc.data.cpu())
        except OSError as e:
            self.stats.record_failure("producer")
            raise ConnectorError(f"shm put of {enc.nbytes} bytes to {self.dir} failed: {e}") from e
        now = time.monotonic()
        with self._lock:
            self._sweep(now)
            self._owned[key] = (path, enc.nbytes, now, now + self.lease_s)
        return self._described_put(
            key, request_id, from_stage, to_stage, enc.kind, enc.dtype, enc.shape, enc.nbytes, path
        )

    @staticmethod
    def _write(path: str, data: torch.Tensor) -> None:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            view = memoryview(data.numpy()) if data.numel() else memoryview(b"")
            written = 0
            while written < len(view):  # os.write may write less than asked (> 2 GiB)
                written += os.write(fd, view[written:])
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)

    def _sweep(self, now: float, full: bool = False) -> None:
        """Drop leases the consumer released (file gone) and unlink expired ones. A put looks
        at the oldest leases only, up to the first one still held (consumers release mostly in
        order), so its cost does not grow with the leases out (a streamed edge has a window of
        chunks out per request, each a lease); every lease is looked at every `full_sweep_s`."""
        full = full or now - self._full_sweep_at >= self.full_sweep_s
        if full:
            self._full_sweep_at = now
        for key in list(self._owned) if full else _oldest_first(self._owned):
            path, nbytes, t0, until = self._owned[key]
            if not os.path.exists(path):
                del self._owned[key]
                self.stats.record_transfer("producer", nbytes, now - t0)
            elif until <= now:
                del self._owned[key]
                _unlink(path)
                self.stats.record_expired()
            elif not full:
                return

    def _remove_orphans(self) -> None:
        try:
            names = os.listdir(self.dir)
        except OSError:
            return
        for fname in names:
            m = _FILE_RE.match(fname)
            if m and not _pid_alive(int(m.group(1))):
                _unlink(os.path.join(self.dir, fname))

    # -- consumer -------------------------------------------------------------------------
    def get(self, desc: PayloadDescriptor, timeout: float) -> Any:
        self._check_desc(desc)
        Deadline(timeout)  # a local file read cannot hang on a peer; validates the argument
        start = time.perf_counter()
        try:
            data = self._map(self._checked_path(desc), desc.nbytes)
        except (OSError, ValueError) as e:
            self.stats.record_failure("consumer")
            raise ConnectorError(
                f"shm payload {desc.key} is not readable ({e}); released, expired, or its producer died"
            ) from e
        payload = decode(desc.kind, desc.dtype, desc.shape, data)
        if isinstance(payload, torch.Tensor) and payload.device != self.device:
            payload = payload.to(self.device)
        self.stats.record_transfer("consumer", desc.nbytes, time.perf_counter() - start)
        return payload

    @staticmethod
    def _map(path: str, nbytes: int) -> torch.Tensor:
        if nbytes == 0:
            if not os.path.exists(path):
                raise FileNotFoundError(path)
            return torch.empty(0, dtype=torch.uint8)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise ValueError(f"file holds {size} bytes, descriptor says {nbytes}")
            # Shared + populate: maps the file's own pages (64 MiB: ~3-10 ms here; the private
            # copy-on-write mapping this replaced copied every page, ~75 ms), paid here rather
            # than by the model's first touch. Writes through the tensor land in the file, which
            # only this consumer still uses.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive as long as needed

    def _checked_path(self, desc: PayloadDescriptor) -> str:
        # Only ever open/unlink files this connector kind made, whatever a descriptor says.
        path = desc.location
        if not isinstance(path, str) or not _FILE_RE.match(os.path.basename(path)):
            raise ConnectorError(f"descriptor {desc.key} does not name an omni shm file: {path!r}")
        if os.path.realpath(os.path.dirname(path)) != os.path.realpath(self.dir):
            raise ConnectorError(f"descriptor {desc.key} names a file outside {self.dir}: {path!r}")
        return path

    def release(self, desc: PayloadDescriptor) -> None:
        try:
            _unlink(self._checked_path(desc))
        except ConnectorError:
            pass
        with self._lock:
            owned = self._owned.pop(desc.key, None)
        if owned is not None:
            self.stats.record_transfer("producer", owned[1], time.monotonic() - owned[2])

    def pending(self) -> int:
        """Payloads this producer still holds (for tests and leak checks)."""
        with self._lock:
            self._sweep(time.monotonic(), full=True)
            return len(self._owned)

    def health(self) -> bool:
        return not self._closed and os.access(self.dir, os.W_OK)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            for path, *_ in self._owned.values():
                _unlink(path)
            self._owned.clear()


def _oldest_first(owned: OrderedDict):
    """The keys of `owned` from its oldest, while the caller deletes the ones it yielded."""
    while owned:
        yield next(iter(owned))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
