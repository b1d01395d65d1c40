"""A persistent staging buffer with a first-fit allocator.

NIXL needs registered memory on both ends of a READ. Registering per transfer costs a few hundred
microseconds and, on the producer, a metadata update the consumer must load; first-touching fresh
pages on the consumer costs more than the copy itself (64 MiB: ~30 ms of page faults here). So each
agent registers one buffer once and carves payload slots out of it.

A CPU slot can be handed out as a tensor that owns the slot: the slot returns to the pool when the
last reference to that tensor dies (`lease_view`), so the consumer returns pool memory without a
copy and without a lifetime API for the caller.

CPU pools are backed by transparent huge pages (2 MiB aligned, madvise(MADV_HUGEPAGE); the host
default here is THP "madvise"). On one host NIXL's UCX reads with process_vm_readv, which pins the
remote pages one struct page at a time: reading 64 MiB out of 4 KiB pages cost ~1.7x a memcpy in
CPU time here, out of huge pages ~1.05x. Pages are still committed only when first touched.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import threading
import weakref

import torch

logger = logging.getLogger(__name__)
ALIGN = 256  # keeps every dtype's alignment and separates slots by cache lines
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A CPU uint8 tensor of `nbytes` whose huge-page-aligned part asks for transparent huge pages.

    Called before the memory is touched, so later first touches fault in 2 MiB pages. Where
    madvise is refused (THP "never", non-Linux) the buffer simply stays on small pages.
    """
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE_PAGE
    buf = raw[start : start + nbytes]  # the view keeps `raw`'s storage alive
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        size = nbytes // HUGE_PAGE * HUGE_PAGE
        if size and libc.madvise(
            ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(size), _MADV_HUGEPAGE
        ):
            logger.debug("madvise(MADV_HUGEPAGE) refused (errno %d)", ctypes.get_errno())
    except (OSError, AttributeError) as e:
        logger.debug("no madvise here: %r", e)
    return buf


def _round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class StagingPool:
    def __init__(self, nbytes: int, device: str | torch.device = "cpu"):
        self.nbytes = _round_up(max(int(nbytes), ALIGN))
        self.device = torch.device(device)
        if self.device.type == "cpu":
            self.buffer = huge_page_buffer(self.nbytes)
        else:
            self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self._np = self.buffer.numpy() if self.device.type == "cpu" else None
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # sorted (offset, size)
        self._used: dict[int, int] = {}  # offset -> size

    @property
    def base_ptr(self) -> int:
        return self.buffer.data_ptr()

    def slot_of(self, ptr: int) -> tuple[int, int] | None:
        """(offset, size) of the allocated slot that starts at address `ptr`, else None."""
        offset = ptr - self.base_ptr
        with self._lock:
            size = self._used.get(offset)
        return None if size is None else (offset, size)

    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._used.values())

    def alloc(self, n: int) -> int | None:
        """Offset of a free slot of at least `n` bytes, or None when the pool is too full."""
        size = _round_up(max(n, 1))
        with self._lock:
            for i, (off, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, free - size)
                    self._used[off] = size
                    return off
        return None

    def free(self, offset: int) -> None:
        with self._lock:
            size = self._used.pop(offset, None)
            if size is None:
                return  # double free is harmless: leases can end by notification and expiry
            i = bisect.bisect_left(self._free, (offset, 0))
            self._free.insert(i, (offset, size))
            # Coalesce with the right, then the left neighbour.
            if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
                self._free[i] = (offset, size + self._free[i + 1][1])
                del self._free[i + 1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
                prev_off, prev_size = self._free[i - 1]
                self._free[i - 1] = (prev_off, prev_size + self._free[i][1])
                del self._free[i]

    def view(self, offset: int, n: int) -> torch.Tensor:
        """A uint8 view of a slot; the caller keeps track of when it is freed."""
        return self.buffer[offset : offset + n]

    def lease_view(self, offset: int, n: int) -> torch.Tensor:
        """A uint8 tensor over a CPU slot that frees the slot when the tensor is garbage."""
        assert self._np is not None, "lease_view is for CPU pools"
        chunk = self._np[offset : offset + n]  # a numpy view: weak-referenceable, owns nothing
        weakref.finalize(chunk, self.free, offset)
        # frombuffer holds a reference to `chunk` for as long as the tensor's storage lives.
        return torch.frombuffer(chunk, dtype=torch.uint8)
