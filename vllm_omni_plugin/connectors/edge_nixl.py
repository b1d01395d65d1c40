"""Large tensor chunks of streamed edges across nodes, through NIXL (connectors/edge_channel.py).

A stage process has one `EdgeNixl`, its NIXL agent created on first use (a stage whose edges
never cross nodes never starts one). The producer's side `offer`s a chunk's tensor: a copy of
it (the chunk is its value at emit time, as an inline one is) is registered where it lies, GPU
or host memory, and an EdgeNixlTensor describing it goes in the chunk's frame. The consumer's
side `read`s one into fresh memory on its own device with a NIXL READ, under a deadline. The
producer `release`s a chunk's registration on its credit, and all of a channel's when the
channel closes for whatever reason (end, EdgeClose, abort, the peer's death: edge_streams.py)
and at the stage's shutdown (`close`).

Bounds: a chunk is at most MAX_CHUNK_BYTES (the consumer refuses larger descriptors before
allocating anything); what a request holds registered is at most its window of chunks, which
the channel asserts; what the process holds registered in all is at most `max_held_bytes`
(a chunk beyond it goes inline, or fails its request if too large for a frame).
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from .base import ConnectorError, ConnectorTimeout, Deadline
from .edge_channel import EdgeNixlTensor
from .stats import ConnectorStats

logger = logging.getLogger("vllm_omni_plugin.connectors.edge_nixl")

# The chunks of a streamed edge are a model's per-step outputs: a frame of hidden states is
# megabytes; a gigabyte is a broken or hostile peer.
MAX_CHUNK_BYTES = 1 << 30
# Registered bytes one stage process holds for its streamed outputs in all (every request's
# window): beyond this a chunk waits in no queue, it goes inline (or fails if it cannot).
DEFAULT_MAX_HELD_BYTES = 2 << 30
# How long a consumer's READ may take before its request fails (a hung or vanished producer).
READ_TIMEOUT_S = 30.0


@dataclass
class _Held:
    tensor: torch.Tensor
    reg: Any
    nbytes: int


def edge_stats(from_stage: int, to_stage: int, path: str) -> ConnectorStats:
    """The counters of one edge's chunks that took `path` ("nixl" or "inline"), exported on
    /metrics as connector `edge_<from>_<to>_<path>` (puts: chunks sent, put_bytes: their
    bytes; consumer transfers: NIXL READs done, with their latency)."""
    return ConnectorStats.for_name(f"edge_{from_stage}_{to_stage}_{path}")


class EdgeNixl:
    """One stage process's NIXL agent for its streamed edges, and what it holds registered."""

    def __init__(self, name_hint: str, max_held_bytes: int = DEFAULT_MAX_HELD_BYTES):
        self.name_hint = name_hint
        self.max_held_bytes = max_held_bytes
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.device_reads = True  # READs land in device memory (False: NIXL refused it here)
        self._agent: Any = None
        self._agent_md = b""
        self.incarnation = secrets.token_hex(8)
        self._agent_lock = threading.Lock()
        self._peers_lock = threading.Lock()  # loading peers' metadata: one READ setup at a time
        self.held: dict[tuple[Hashable, int], _Held] = {}  # (channel, seq) -> registration
        self.held_bytes = 0
        self.closed = False

    @property
    def agent(self) -> Any:
        with self._agent_lock:
            if self.closed:
                raise ConnectorError("the stage's NIXL agent is closed")
            if self._agent is None:
                from .nixl_agent import NixlAgent

                name = f"omni-edge-{self.name_hint}-{socket.gethostname()}-{os.getpid()}"
                self._agent = NixlAgent(f"{name}-{self.incarnation[:6]}")
                self._agent_md = self._agent.metadata()
                # Stop NIXL's threads while the interpreter still runs: an agent destroyed
                # during its teardown aborts the process.
                atexit.register(_close_at_exit, weakref.ref(self))
            return self._agent

    # ---- the producer's side -------------------------------------------------------------
    def offer(self, channel: Hashable, seq: int, tensor: torch.Tensor) -> EdgeNixlTensor | None:
        """Register a copy of `tensor` as chunk `seq` of `channel` and describe it; None when
        it is above MAX_CHUNK_BYTES or the process already holds `max_held_bytes` (the chunk
        then goes inline). ConnectorError when NIXL is unusable here."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > MAX_CHUNK_BYTES or self.held_bytes + nbytes > self.max_held_bytes:
            return None
        agent = self.agent
        data = tensor.detach().clone(memory_format=torch.contiguous_format)
        if data.is_cuda:
            # The copy (and what computed the tensor) runs on the GPU's stream: a READ the
            # consumer starts once the descriptor is out must find it done.
            torch.cuda.current_stream(data.device).synchronize()
        flat = data.reshape(-1).view(torch.uint8)
        reg = agent.register(flat)
        try:
            region_md = agent.partial_metadata(reg)
        except ConnectorError:
            agent.deregister(reg)
            raise
        self.held[(channel, seq)] = _Held(data, reg, nbytes)
        self.held_bytes += nbytes
        on_gpu = data.device.type != "cpu"
        return EdgeNixlTensor(
            str(data.dtype).removeprefix("torch."),
            tuple(data.shape),
            nbytes,
            agent.name,
            self.incarnation,
            self._agent_md,
            region_md,
            flat.data_ptr(),
            max(data.get_device(), 0) if on_gpu else 0,
            "VRAM" if on_gpu else "DRAM",
        )

    def release(self, channel: Hashable, seq: int) -> None:
        held = self.held.pop((channel, seq), None)
        if held is None:
            return
        self.held_bytes -= held.nbytes
        if self._agent is not None:
            self._agent.deregister(held.reg)

    def release_channel(self, channel: Hashable) -> None:
        for key in [k for k in self.held if k[0] == channel]:
            self.release(*key)

    def held_by(self, channel: Hashable) -> int:
        """Chunks of `channel` registered now."""
        return sum(1 for k in self.held if k[0] == channel)

    # ---- the consumer's side -------------------------------------------------------------
    def read(
        self, ref: EdgeNixlTensor, stats: ConnectorStats, timeout: float = READ_TIMEOUT_S
    ) -> torch.Tensor:
        """The chunk's tensor, READ from the producer into fresh memory on this process's
        device (blocking: run it off the event loop), counted in `stats`. ConnectorError
        (ConnectorTimeout past `timeout`) when the descriptor is malformed or the READ fails."""
        try:
            t0 = time.perf_counter()
            tensor = self._read(ref, timeout)
        except ConnectorError as exc:
            stats.record_failure("consumer", timeout=isinstance(exc, ConnectorTimeout))
            raise
        stats.record_transfer("consumer", ref.nbytes, time.perf_counter() - t0)
        return tensor

    def _read(self, ref: EdgeNixlTensor, timeout: float) -> torch.Tensor:
        dtype = getattr(torch, ref.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ConnectorError(f"a NIXL chunk of unknown dtype {ref.dtype!r}")
        numel = 1
        for dim in ref.shape:
            if dim < 0:
                raise ConnectorError(f"a NIXL chunk of shape {ref.shape}")
            numel *= dim
        if ref.nbytes != numel * dtype.itemsize or not 0 < ref.nbytes <= MAX_CHUNK_BYTES:
            raise ConnectorError(
                f"a NIXL chunk of {ref.nbytes} bytes for {ref.dtype} {tuple(ref.shape)}"
            )
        if ref.mem_type not in ("DRAM", "VRAM"):
            raise ConnectorError(f"a NIXL chunk in {ref.mem_type!r} memory")
        deadline = Deadline(timeout)
        agent = self.agent
        with self._peers_lock:
            agent.ensure_peer(ref.agent_name, ref.incarnation, ref.agent_md)
            agent.load_partial(ref.agent_name, ref.incarnation, ref.agent_md, ref.region_md)
            buf, reg = self._registered_buffer(agent, ref.nbytes)
        in_use = False
        try:
            agent.read(
                buf,
                [(ref.addr, ref.nbytes, ref.dev_id)],
                ref.mem_type,
                ref.agent_name,
                b"",
                deadline,
            )
        except ConnectorError as exc:
            # A READ NIXL could not cancel may still land: its buffer stays registered.
            in_use = getattr(exc, "local_in_use", False)
            agent.forget_peer(ref.agent_name)  # its next descriptor handshakes afresh
            raise
        finally:
            if not in_use:
                agent.deregister(reg)
        return buf.view(dtype).reshape(ref.shape).to(self.device)

    def _registered_buffer(self, agent: Any, nbytes: int) -> tuple[torch.Tensor, Any]:
        """Fresh memory for a READ on this process's device, registered; host memory where
        NIXL cannot register the device's (a UCX built without its GPU transport)."""
        if self.device.type != "cpu" and self.device_reads:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            try:
                return buf, agent.register(buf)
            except ConnectorError as exc:
                self.device_reads = False
                logger.warning(
                    "NIXL cannot register %s memory (%s): streamed chunks are read into host "
                    "memory, then copied there",
                    self.device,
                    exc,
                )
        buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf, agent.register(buf)

    # ---- the stage's end -----------------------------------------------------------------
    def close(self) -> None:
        """Release every registration and stop the agent (the stage is shutting down)."""
        for key in list(self.held):
            self.release(*key)
        with self._agent_lock:
            self.closed = True
            agent, self._agent = self._agent, None
        if agent is not None:
            agent.shutdown()


def _close_at_exit(ref: weakref.ref) -> None:
    edges = ref()
    if edges is not None:
        edges.close()
