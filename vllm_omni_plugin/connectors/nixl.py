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

The connector is its two halves plus their shared state: `nixl_producer.py` (put, leases, the
reaper), `nixl_consumer.py` (get, release), `nixl_types.py` (the location and the lease).
"""

from __future__ import annotations

import atexit
import os
import secrets
import socket
import threading
import weakref
from collections import OrderedDict

import torch

from vllm_omni_plugin.connectors.base import StageConnector
from vllm_omni_plugin.connectors.nixl_agent import NixlAgent
from vllm_omni_plugin.connectors.nixl_consumer import NixlConsumer
from vllm_omni_plugin.connectors.nixl_producer import NixlProducer
from vllm_omni_plugin.connectors.nixl_types import Lease, MiB, NixlLocation
from vllm_omni_plugin.connectors.staging import StagingPool

__all__ = ["NixlConnector", "NixlLocation"]


class NixlConnector(NixlProducer, NixlConsumer, StageConnector):
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
        self._leases: dict[str, Lease] = {}
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
