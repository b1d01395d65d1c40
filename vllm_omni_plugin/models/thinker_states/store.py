"""The stage-process side: a ZMQ PULL socket the vLLM worker pushes each step's states to, read on
a thread into per-request queues, bounded, and released as consumed or when the request ends.

Lifecycle of one request (its key is what the stage put in `extra_args[REQUEST_KEY]`):
  open(key)            before the request enters the engine; states for unknown keys are dropped
  take(key) / stream   consume chunks in position order (a consumed chunk is no longer held)
  finish(key, n)       the engine says the request finished; n = positions that had a forward
                       (prompt + generated - 1: the last sampled token is never fed back). The
                       stream ends once positions < n are consumed; later positions are dropped
  release(key)         drop everything now (abort, or done with it); later chunks are dropped

Bounds: a request holding more than `max_request_bytes`, or a chunk that would take the store
past `max_total_bytes`, fails that request: its data is dropped and its consumer gets
`StatesOverflow`. Nothing blocks the worker, so a slow consumer costs its own request, never the
engine's other requests.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field

import torch

from .settings import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_TOTAL_BYTES, StepHeader

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class StatesOverflow(RuntimeError):
    """The request's states passed a bound; they were dropped. `own` when the request alone
    passed `max_request_bytes` (else the stage's total passed `max_total_bytes`)."""

    def __init__(self, message: str, own: bool = False):
        super().__init__(message)
        self.own = own


@dataclass
class StatesChunk:
    """Positions [start, start + count) of one request; `layers[k]` is `[count, dim]`."""

    start: int
    layers: dict[int, torch.Tensor]

    @property
    def count(self) -> int:
        return int(next(iter(self.layers.values())).shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers.values())


@dataclass
class _Entry:
    queue: deque = field(default_factory=deque)
    held: int = 0
    next_pos: int = 0  # first position not yet received
    end: int | None = None  # positions that will ever come (known at finish)
    error: str | None = None
    own_error: bool = False  # the request alone passed its bound


class ThinkerStatesStore:
    def __init__(
        self,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
        endpoint: str | None = None,
        accept_layer: int | None = None,
    ):
        import zmq

        # The decoder-layer input the talker reads (the other captured layer is 0).
        self.accept_layer = accept_layer
        self.max_request_bytes = max_request_bytes
        self.max_total_bytes = max_total_bytes
        self._dir = None
        if endpoint is None:
            self._dir = tempfile.mkdtemp(prefix="omni-states-")
            os.chmod(self._dir, 0o700)  # only this user's processes can connect
            endpoint = f"ipc://{self._dir}/{uuid.uuid4().hex[:12]}.sock"
        self.endpoint = endpoint
        self._entries: dict[str, _Entry] = {}
        self._held = 0
        # Positions received again (a recompute the worker did not filter): kept once, counted.
        self.repeated_positions = 0
        self._cond = threading.Condition()
        # The process's shared context, never garbage: a context of its own, collected in the
        # same cycle as its socket, would block the collection in pyzmq's finalizer.
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="thinker-states", daemon=True)
        self._thread.start()

    # ---- bookkeeping -------------------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        with self._cond:
            return self._held

    def held(self, key: str) -> int:
        with self._cond:
            entry = self._entries.get(key)
            return entry.held if entry else 0

    def keys(self) -> list[str]:
        with self._cond:
            return list(self._entries)

    def open(self, key: str) -> None:
        with self._cond:
            if key in self._entries:
                raise ValueError(f"thinker states: {key!r} is already open")
            self._entries[key] = _Entry()

    def finish(self, key: str, num_positions: int) -> None:
        with self._cond:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry.end = num_positions
            self._trim(entry)
            self._cond.notify_all()

    def release(self, key: str) -> None:
        with self._cond:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._held -= entry.held
            self._cond.notify_all()

    # ---- consuming ---------------------------------------------------------------------------
    def take(self, key: str, timeout: float | None = None) -> list[StatesChunk] | None:
        """The chunks received so far, in position order, no longer held; waits up to `timeout`
        for one. [] on timeout; None once every position has been consumed (stream over)."""
        with self._cond:
            entry = self._entries.get(key)
            if entry is None:
                raise KeyError(f"thinker states: {key!r} is not open")
            self._cond.wait_for(
                lambda: entry.queue or entry.error or self._done(entry) or self._closed,
                timeout,
            )
            if entry.error:
                raise StatesOverflow(entry.error, entry.own_error)
            if not entry.queue and self._done(entry):
                return None
            out = list(entry.queue)
            entry.queue.clear()
            self._held -= entry.held
            entry.held = 0
            return out

    async def stream(self, key: str, poll_s: float = 0.05):
        """Async iterator over the request's chunks until its last position."""
        while True:
            chunks = await asyncio.to_thread(self.take, key, poll_s)
            if chunks is None:
                return
            for chunk in chunks:
                yield chunk

    def collect(self, key: str, timeout: float = 30.0) -> StatesChunk:
        """Every position of a finished request in one chunk (waits for those in flight)."""
        import time

        deadline = time.monotonic() + timeout
        parts: list[StatesChunk] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"thinker states of {key!r} incomplete")
            got = self.take(key, left)
            if got is None:
                break
            parts.extend(got)
        if not parts:
            return StatesChunk(0, {})
        layers = {k: torch.cat([p.layers[k] for p in parts]) for k in parts[0].layers}
        return StatesChunk(parts[0].start, layers)

    # ---- receiving (its own thread) -------------------------------------------------------------
    @staticmethod
    def _done(entry: _Entry) -> bool:
        return entry.end is not None and entry.next_pos >= entry.end

    def _trim(self, entry: _Entry) -> None:
        # Positions past the end (a stop string detected after the engine ran another step)
        # are no part of the answer.
        while entry.queue and entry.end is not None and entry.queue[-1].start >= entry.end:
            gone = entry.queue.pop()
            entry.held -= gone.nbytes
            self._held -= gone.nbytes
        if entry.queue and entry.end is not None:
            last = entry.queue[-1]
            over = last.start + last.count - entry.end
            if over > 0:
                before = last.nbytes
                last.layers = {k: t[: last.count - over].clone() for k, t in last.layers.items()}
                entry.held -= before - last.nbytes
                self._held -= before - last.nbytes

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._closed:
            try:
                if not poller.poll(100):
                    continue
                frames = self._sock.recv_multipart(copy=False)
            except zmq.ZMQError:
                return
            self._receive(frames)

    def _receive(self, frames) -> None:
        header = StepHeader.decode(bytes(frames[0].buffer))
        dtype = _DTYPES[header.dtype]
        per_layer = [
            torch.frombuffer(bytearray(f.buffer), dtype=dtype).view(-1, header.dim)
            for f in frames[1:]
        ]
        offset = 0
        with self._cond:
            for ch in header.chunks:
                rows = slice(offset, offset + ch.count)
                offset += ch.count
                entry = self._entries.get(ch.key)
                if entry is None or entry.error:
                    continue  # not opened, released, or failed: nobody will read it
                self._add(entry, ch.key, ch.start, header.layers, [t[rows] for t in per_layer])
            self._cond.notify_all()

    def _add(self, entry: _Entry, key, start, layers, tensors) -> None:
        first = max(start, entry.next_pos)  # a position seen already is not kept twice
        last = start + tensors[0].shape[0]
        self.repeated_positions += max(0, min(last, entry.next_pos) - start)
        if entry.end is not None:
            last = min(last, entry.end)
        if first >= last:
            return
        chunk = StatesChunk(
            first,
            {
                k: t[first - start : last - start].clone()
                for k, t in zip(layers, tensors, strict=True)
            },
        )
        size = chunk.nbytes
        if entry.held + size > self.max_request_bytes:
            self._fail(entry, f"request {key!r} passed {self.max_request_bytes} bytes held")
            entry.own_error = True
            return
        if self._held + size > self.max_total_bytes:
            self._fail(entry, f"the stage passed {self.max_total_bytes} bytes held")
            return
        entry.queue.append(chunk)
        entry.held += size
        self._held += size
        entry.next_pos = last

    def _fail(self, entry: _Entry, why: str) -> None:
        entry.error = f"thinker states dropped: {why}"
        entry.queue.clear()
        self._held -= entry.held
        entry.held = 0

    def close(self) -> None:
        self._closed = True
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=2)
        self._sock.close(0)
        if self._dir is not None:
            import shutil

            shutil.rmtree(self._dir, ignore_errors=True)
