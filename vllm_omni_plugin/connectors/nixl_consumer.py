"""The consumer half of the NIXL connector: READ a payload into the receive pool (CPU) or fresh
registered memory on the connector's device (GPU), check its slot tag, decode it, and release it.

A mixin of `NixlConnector` (nixl.py), which owns the state used here: `agent`, `recv_pool`,
`send_pool`, `device`, `_leases`/`_lock` (a payload this very connector produced), `_notified`,
`stats`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from vllm_omni_plugin.connectors.base import (
    ConnectorError,
    ConnectorTimeout,
    Deadline,
    PayloadDescriptor,
)
from vllm_omni_plugin.connectors.nixl_types import HEADER, RELEASE_PREFIX, NixlLocation
from vllm_omni_plugin.connectors.serialization import decode

logger = logging.getLogger(__name__)


class NixlConsumer:
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
            self.agent.load_partial(loc.agent_name, loc.incarnation, loc.agent_md, loc.region_md)
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
