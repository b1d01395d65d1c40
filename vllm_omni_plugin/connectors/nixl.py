"""NIXL connector: the consumer pulls the payload with a NIXL READ; only a descriptor travels.

Producer (put): payloads up to `copy_threshold` bytes are copied into a slot of a send pool that was
registered once (no per-put registration, no metadata change); larger ones, and device tensors,
are registered where they lie (no copy) and their partial metadata rides in the descriptor. A
producer that builds its payload in `empty()` (a tensor inside the send pool) gets neither a copy
nor a registration; on one host that is also the fastest READ source (huge pages, staging.py).
The descriptor also carries the agent's metadata and incarnation, so a consumer handshakes on first
contact and again after the producer restarted. The producer frees a payload when the consumer's
READ notification arrives, when the consumer releases it, or when its lease expires.

Consumer (get): READ into a slot of its own registered receive pool (CPU) and return a tensor that
owns the slot (freed when the tensor dies), or into fresh registered memory on `device`.
Small slots start with a header holding a per-put tag: a late READ of a slot that was reused after
lease expiry is detected instead of returning someone else's bytes.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_plugin.connectors.base import (
    ConnectorError,
    ConnectorTimeout,
    Deadline,
    PayloadDescriptor,
    StageConnector,
    new_key,
)
from vllm_omni_plugin.connectors.nixl_agent import NixlAgent
from vllm_omni_plugin.connectors.serialization import decode, encode
from vllm_omni_plugin.connectors.staging import ALIGN, StagingPool

logger = logging.getLogger(__name__)
HEADER = ALIGN  # tag in the first 8 bytes; the payload after it stays aligned
RELEASE_PREFIX = b"omni-rel:"
MiB = 1 << 20


@dataclass(frozen=True)
class NixlLocation:
    agent_name: str
    incarnation: str
    agent_md: bytes
    region_md: bytes | None  # partial metadata of a payload registered on its own
    addr: int
    length: int  # bytes to READ (header + payload for pool slots)
    dev_id: int
    mem_type: str  # DRAM | VRAM
    tag: int  # 0: no header


@dataclass
class _Lease:
    nbytes: int
    t0: float
    until: float
    offset: int | None = None  # send-pool slot
    tensor: torch.Tensor | None = None  # payload registered in place, or an empty() payload
    reg: Any = None
    tag_offset: int | None = None  # empty() payload: its slot's tag, cleared at release


class NixlConnector(StageConnector):
    kind = "nixl"

    def __init__(
        self,
        name: str | None = None,
        lease_s: float = 300.0,
        device: str = "cpu",
        agent_name: str | None = None,
        send_pool_mb: float = 256,
        recv_pool_mb: float = 192,
        copy_threshold_mb: float = 1,
        poll_interval_s: float = 0.005,
        progress_delay_us: int = 20,
        backends: tuple[str, ...] = ("UCX",),
    ):
        super().__init__(name, lease_s)
        self.device = torch.device(device)
        self.copy_threshold = int(copy_threshold_mb * MiB)
        self.poll_interval_s = poll_interval_s
        self.incarnation = secrets.token_hex(8)
        name_part = self.name.replace(":", "_")
        self.agent = NixlAgent(
            agent_name
            or f"omni-{name_part}-{socket.gethostname()}-{os.getpid()}-{self.incarnation[:6]}",
            tuple(backends),
            progress_delay_us,
        )
        # Pools are virtual until touched: registering them costs ~1 ms, not their size in RSS.
        # The send pool also holds `empty()` payloads, hence room for a few 64 MiB ones.
        self.send_pool = StagingPool(int(send_pool_mb * MiB))
        self.recv_pool = StagingPool(int(recv_pool_mb * MiB)) if self.device.type == "cpu" else None
        self._regs = [self.agent.register(self.send_pool.buffer)]
        if self.recv_pool is not None:
            self._regs.append(self.agent.register(self.recv_pool.buffer))
        self._agent_md = self.agent.metadata()  # after the pools: it lists their registrations
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._notified: OrderedDict[str, None] = (
            OrderedDict()
        )  # keys whose READ carried the release
        self._closed = threading.Event()
        self._reaper = threading.Thread(
            target=self._reap_loop, name=f"omni-nixl-{self.name}", daemon=True
        )
        self._reaper.start()
        # Stop NIXL's threads while the interpreter is still alive: destroying an agent during
        # interpreter teardown aborts the process ("terminate called without an active exception").
        atexit.register(_close_at_exit, weakref.ref(self))

    @property
    def agent_name(self) -> str:
        return self.agent.name

    # -- producer -------------------------------------------------------------------------
    def empty(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor inside the registered send pool, for a payload to `put`.

        put() of this very tensor (not a slice of it) sends it without a copy or a registration.
        Its pool slot returns when the tensor and every descriptor put from it are done. Falls
        back to ordinary memory when the pool is full. Put it once per fill: a second put of the
        same tensor invalidates descriptors of the first (their get raises ConnectorError).
        """
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        offset = self.send_pool.alloc(HEADER + nbytes)
        if offset is None:
            return torch.empty(tuple(shape), dtype=dtype)
        slot = self.send_pool.lease_view(offset, HEADER + nbytes)  # frees the slot when garbage
        slot[:8].view(torch.int64)[0] = 0  # no put yet: no READ may succeed
        return slot[HEADER:].view(dtype).reshape(tuple(shape))

    def put(
        self, request_id: str, from_stage: int, to_stage: int, payload: Any
    ) -> PayloadDescriptor:
        if self._closed.is_set():
            raise ConnectorError(f"connector {self.name!r} is closed")
        enc = encode(payload)
        key = new_key(request_id, from_stage, to_stage)
        now = time.monotonic()
        lease = _Lease(enc.nbytes, now, now + self.lease_s)
        location = None
        try:
            if enc.nbytes:
                location = self._stage(enc.data, lease)
        except ConnectorError:
            self.stats.record_failure("producer")
            raise
        if enc.nbytes:
            with self._lock:
                self._leases[key] = lease
        return self._described_put(
            key,
            request_id,
            from_stage,
            to_stage,
            enc.kind,
            enc.dtype,
            enc.shape,
            enc.nbytes,
            location,
        )

    def _stage(self, data: torch.Tensor, lease: _Lease) -> NixlLocation:
        n = data.numel()
        if data.device.type == "cpu":
            slot = self.send_pool.slot_of(data.data_ptr() - HEADER)
            if slot is not None and HEADER + n <= slot[1]:  # built in empty(): already registered
                tag = secrets.randbits(63) | 1
                self.send_pool.view(slot[0], 8).view(torch.int64)[0] = tag
                lease.tensor, lease.tag_offset = data, slot[0]  # keeps the slot until released
                return self._location(
                    None, self.send_pool.base_ptr + slot[0], HEADER + n, 0, "DRAM", tag
                )
        small = data.device.type == "cpu" and n <= self.copy_threshold
        offset = self.send_pool.alloc(HEADER + n) if small else None
        if offset is not None:
            tag = secrets.randbits(63) | 1
            slot = self.send_pool.view(offset, HEADER + n)
            slot[:8].view(torch.int64)[0] = tag
            # A plain memcpy: torch's copy_ goes through its intra-op thread pool, which on a
            # busy 2-core host made a 1 MiB copy cost 7 ms instead of 0.07 ms.
            ctypes.memmove(slot.data_ptr() + HEADER, data.data_ptr(), n)
            lease.offset = offset
            return self._location(
                None, self.send_pool.base_ptr + offset, HEADER + n, 0, "DRAM", tag
            )
        # Large or device payload: register it where it lies and keep it alive until released.
        lease.tensor, lease.reg = data, self.agent.register(data)
        dev_id = max(data.get_device(), 0)
        mem_type = "DRAM" if data.device.type == "cpu" else "VRAM"
        try:
            region_md = self.agent.partial_metadata(lease.reg)
        except ConnectorError:
            self.agent.deregister(lease.reg)
            raise
        return self._location(region_md, data.data_ptr(), n, dev_id, mem_type, 0)

    def _location(
        self, region_md: bytes | None, addr: int, length: int, dev: int, mem: str, tag: int
    ) -> NixlLocation:
        return NixlLocation(
            self.agent.name,
            self.incarnation,
            self._agent_md,
            region_md,
            addr,
            length,
            dev,
            mem,
            tag,
        )

    def _free_lease(self, key: str, why: str) -> None:
        with self._lock:
            lease = self._leases.pop(key, None)
        if lease is None:
            return  # already freed (notification and release both arrive) or not ours
        if lease.offset is not None:
            # Clear the tag so a READ arriving after expiry is detected, not served stale bytes.
            self.send_pool.view(lease.offset, 8).zero_()
            self.send_pool.free(lease.offset)
        if lease.tag_offset is not None:  # the slot itself lives until its tensor dies
            self.send_pool.view(lease.tag_offset, 8).zero_()
        if lease.reg is not None:
            self.agent.deregister(lease.reg)
        if why == "expired":
            self.stats.record_expired()
        else:
            self.stats.record_transfer("producer", lease.nbytes, time.monotonic() - lease.t0)

    def _reap_loop(self) -> None:
        # Poll often only while payloads are out: an idle connector should cost ~nothing.
        while not self._closed.wait(self.poll_interval_s * (1 if self._leases else 20)):
            try:
                self._reap_once()
            except Exception as e:  # the reaper must survive a transient NIXL error
                logger.warning("NIXL connector %s: reaper error: %r", self.name, e)

    def _reap_once(self) -> None:
        for messages in self.agent.new_notifs().values():
            for msg in messages:
                if msg.startswith(RELEASE_PREFIX):
                    self._free_lease(msg[len(RELEASE_PREFIX) :].decode(), "released")
        now = time.monotonic()
        with self._lock:
            expired = [k for k, lease in self._leases.items() if lease.until <= now]
        for key in expired:
            self._free_lease(key, "expired")

    def pending(self) -> int:
        """Payloads this producer still holds (for tests and leak checks)."""
        with self._lock:
            return len(self._leases)

    # -- consumer -------------------------------------------------------------------------
    def get(self, desc: PayloadDescriptor, timeout: float) -> Any:
        self._check_desc(desc)
        deadline = Deadline(timeout)
        start = time.perf_counter()
        try:
            payload = self._fetch(desc, deadline)
        except ConnectorError as e:
            self.stats.record_failure("consumer", timeout=isinstance(e, ConnectorTimeout))
            raise
        self.stats.record_transfer("consumer", desc.nbytes, time.perf_counter() - start)
        return payload

    def _fetch(self, desc: PayloadDescriptor, deadline: Deadline) -> Any:
        loc: NixlLocation | None = desc.location
        if loc is None:  # empty payload: nothing to read
            return decode(desc.kind, desc.dtype, desc.shape, torch.empty(0, dtype=torch.uint8))
        if not isinstance(loc, NixlLocation):
            raise ConnectorError(f"descriptor {desc.key} carries no NIXL location")
        if loc.agent_name == self.agent.name:
            return self._fetch_own(desc)
        self.agent.ensure_peer(loc.agent_name, loc.incarnation, loc.agent_md)
        if loc.region_md is not None:
            self.agent.load_partial(loc.region_md)
        offset = self.recv_pool.alloc(loc.length) if self.recv_pool is not None else None
        fresh: torch.Tensor | None = None
        reg = None
        if offset is None:
            fresh = torch.empty(loc.length, dtype=torch.uint8, device=self.device)
            reg = self.agent.register(fresh)
        local = [(self.recv_pool.base_ptr + offset, loc.length, 0)] if offset is not None else fresh
        notif = RELEASE_PREFIX + desc.key.encode()
        in_use = False
        try:
            self.agent.read(
                local,
                [(loc.addr, loc.length, loc.dev_id)],
                loc.mem_type,
                loc.agent_name,
                notif,
                deadline,
            )
        except ConnectorError as e:
            in_use = getattr(e, "local_in_use", False)  # then quarantined: a late READ may land
            self.agent.forget_peer(loc.agent_name)  # next descriptor from it handshakes afresh
            if offset is not None and not in_use:
                self.recv_pool.free(offset)
            raise
        finally:
            if reg is not None and not in_use:
                self.agent.deregister(reg)
        self._remember_notified(desc.key)
        return self._unpack(desc, loc, offset, fresh)

    def _fetch_own(self, desc: PayloadDescriptor) -> Any:
        """Producer and consumer are this very connector: copy from the lease, no NIXL."""
        with self._lock:
            lease = self._leases.get(desc.key)
            if lease is None:
                raise ConnectorError(f"payload {desc.key} was released or its lease expired")
            if lease.offset is not None:
                data = self.send_pool.view(lease.offset + HEADER, lease.nbytes).clone()
            else:
                assert lease.tensor is not None
                data = lease.tensor.clone()
        payload = decode(desc.kind, desc.dtype, desc.shape, data)
        if isinstance(payload, torch.Tensor) and payload.device != self.device:
            payload = payload.to(self.device)
        return payload

    def _unpack(
        self,
        desc: PayloadDescriptor,
        loc: NixlLocation,
        offset: int | None,
        fresh: torch.Tensor | None,
    ) -> Any:
        if offset is not None and (desc.kind != "tensor"):
            view = self.recv_pool.view(offset, loc.length)
        elif offset is not None:
            view = self.recv_pool.lease_view(offset, loc.length)  # the tensor owns the slot
        else:
            view = fresh
        assert view is not None
        try:
            if loc.tag and int(view[:8].view(torch.int64)[0]) != loc.tag:
                raise ConnectorError(
                    f"payload {desc.key} was freed by its producer before this read (lease expired)"
                )
            data = view[HEADER:] if loc.tag else view
            return decode(desc.kind, desc.dtype, desc.shape, data)
        finally:
            if offset is not None and desc.kind != "tensor":
                self.recv_pool.free(offset)  # bytes/objects were copied out by decode

    def _remember_notified(self, key: str) -> None:
        with self._lock:
            self._notified[key] = None
            if len(self._notified) > 4096:
                self._notified.popitem(last=False)

    def release(self, desc: PayloadDescriptor) -> None:
        loc = desc.location
        if not isinstance(loc, NixlLocation):
            return
        if loc.agent_name == self.agent.name:
            self._free_lease(desc.key, "released")
            return
        with self._lock:
            if self._notified.pop(desc.key, 0) is None:
                return  # the READ's notification already released it
        try:  # released without a get (e.g. the request was aborted)
            self.agent.ensure_peer(loc.agent_name, loc.incarnation, loc.agent_md)
            self.agent.notify(loc.agent_name, RELEASE_PREFIX + desc.key.encode())
        except ConnectorError as e:
            logger.info("release of %s not delivered (its lease will expire): %s", desc.key, e)

    # -- lifecycle ------------------------------------------------------------------------
    def health(self) -> bool:
        return not self._closed.is_set() and self._reaper.is_alive()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._reaper.join(timeout=5)
        for key in list(self._leases):
            self._free_lease(key, "expired")
        for reg in self._regs:
            self.agent.deregister(reg)
        self._regs.clear()
        self.agent.shutdown()


def _close_at_exit(ref: weakref.ref) -> None:
    conn = ref()
    if conn is not None:
        conn.close()
