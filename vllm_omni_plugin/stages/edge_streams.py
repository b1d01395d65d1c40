"""Streamed edges between two stages: each request's chunks over its own channel, peer to peer.

The producer connects to the consumer's listener (the address the consumer announced in its
Ready, handed over in the producer's Submit as `stream_to`), says which request and edge it
carries with the orchestrator's token, and writes its chunks; the consumer writes a credit back
per chunk it finished with (connectors/edge_channel.py has the wire). The API server sees none
of it: it learns of the edge only through the stages' Results, Pulses (each chunk sent or
consumed is progress) and StreamWait reports.

* Order: chunks carry consecutive sequence numbers, checked as they arrive; a gap, a chunk
  beyond the window or a frame outside the schema is an error of the request.
* Back-pressure: the producer has at most `window` chunks out unacknowledged; `emit` waits for
  a credit beyond that. The consumer holds at most the window (+ the end marker) and refuses
  more.
* Lifetime: the channel belongs to the request. The producer ends it with the end marker (its
  run returned) and closes; a consumer that returns before the end says EdgeClose and the
  producer emits into nothing from then on. An Abort closes both ends at once and drops what
  they hold. When one end dies, the other reads EOF at once: it drops the channel and its
  buffers there and then, and its request waits (reported as waiting, so the watchdog leaves
  it alone) for the orchestrator's Abort, which follows the death of the peer's process or its
  error Result; the request fails with that cause, not with this side's view of it. Should no
  Abort come within PEER_LOST_GRACE_S the request fails here.
* The stall watchdog: a request that waits on its peer (a consumer with nothing to read, a
  producer with a full window, either after losing its peer) tells the orchestrator with a
  StreamWait once the wait lasted WAIT_REPORT_S (short waits, one per chunk, cost nothing),
  and again when it ends: its clock stops meanwhile, as it did when the API server relayed.
* Across nodes: a stage on a headless node also listens on TCP (its node names the address,
  EDGE_TCP_HOST_ENV), and the head hands a producer elsewhere that address. The same messages
  and rules hold; the frames are sealed under a key from the request's token, which the
  consumer learns from its Submit (a connection that came first is held unread until then).
  A tensor chunk of at least the producer's `stream_nixl_min_bytes` stays in its memory,
  registered with its NIXL agent (connectors/edge_nixl.py), and only its descriptor goes in
  the frame; the consumer READs it as it arrives, into memory on its own device, and the
  chunk then counts as arrived. The producer holds the registration until the chunk's credit,
  or until the channel closes (end, EdgeClose, abort, its peer's death) or the stage stops:
  at most the window's chunks per request. A READ that fails (or outlasts its deadline)
  fails the request; the wait for it is a wait on the peer, as the watchdog sees it. Local
  edges keep every chunk inline: on one host a READ of process memory is a copy, as the
  socket's is.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..common.messages import PULSE_INTERVAL_S, StreamWait, Submit
from ..common.payload import InlineTensor
from ..connectors.base import ConnectorError
from ..connectors.edge_channel import (
    EDGE_TCP_HOST_ENV,
    EdgeChannelError,
    EdgeChunk,
    EdgeClose,
    EdgeCredit,
    EdgeHello,
    EdgeLink,
    EdgeListener,
    EdgeMessage,
    EdgeNixlTensor,
    EdgeNonce,
    FrameSeal,
    connect,
    is_tcp,
    new_nonce,
)
from ..connectors.edge_nixl import EdgeNixl, edge_stats
from .payloads import from_inline, inline

logger = logging.getLogger("vllm_omni_plugin.stages.streams")

# A wait shorter than this is not reported (at most one report per pulse interval).
WAIT_REPORT_S = PULSE_INTERVAL_S
# How long a request whose peer vanished waits for the orchestrator's Abort before failing.
PEER_LOST_GRACE_S = 30.0
# Connections whose request this stage does not know yet (its Submit is on the way), and how
# long one may stay silent before saying which request it carries.
MAX_UNCLAIMED = 256
MAX_UNCLAIMED_WINDOW = 64  # chunks one such connection may deliver before its Submit came
HELLO_TIMEOUT_S = 30.0


class StreamError(RuntimeError):
    """A streamed edge broke its contract (a gap in the sequence, no such stream, a lost peer)."""


class StreamUnavailable(StreamError):
    """A chunk its producer could not hand over (a NIXL READ that failed or outlasted its
    deadline): the request fails as when a stage is down (503), not as its own fault."""


class Waits:
    """Per request: how many of its tasks wait on a peer now; a StreamWait goes out once a
    wait lasted WAIT_REPORT_S, and its end goes out when the last wait ends."""

    def __init__(self, loop: asyncio.AbstractEventLoop, report: Callable[[str, bool], None]):
        self.loop = loop
        self.report = report
        self.count: dict[str, int] = {}
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.reported: set[str] = set()

    def begin(self, rid: str) -> None:
        n = self.count.get(rid, 0)
        self.count[rid] = n + 1
        if n == 0 and rid not in self.reported:
            self.timers[rid] = self.loop.call_later(WAIT_REPORT_S, self._fire, rid)

    def end(self, rid: str) -> None:
        n = self.count.get(rid, 0) - 1
        if n > 0:
            self.count[rid] = n
            return
        self.count.pop(rid, None)
        timer = self.timers.pop(rid, None)
        if timer is not None:
            timer.cancel()
        if rid in self.reported:
            self.reported.discard(rid)
            self.report(rid, False)

    def _fire(self, rid: str) -> None:
        self.timers.pop(rid, None)
        if self.count.get(rid):
            self.reported.add(rid)
            self.report(rid, True)

    def forget(self, rid: str) -> None:
        self.count.pop(rid, None)
        self.reported.discard(rid)
        timer = self.timers.pop(rid, None)
        if timer is not None:
            timer.cancel()


class _Waiting:
    """`async with` around a wait on the peer."""

    def __init__(self, waits: Waits, rid: str):
        self.waits, self.rid = waits, rid

    async def __aenter__(self) -> None:
        self.waits.begin(self.rid)

    async def __aexit__(self, *exc: Any) -> None:
        self.waits.end(self.rid)


class DirectOutput:
    """A producer's end of one request's edge."""

    def __init__(self, hub: EdgeHub, msg: Submit, from_stage: int, window: int):
        self.hub = hub
        self.request_id = msg.request_id
        self.from_stage = from_stage
        self.to_stage = msg.to_stage
        self.window = window
        self.channel = hub.new_channel(msg.request_id)  # files its chunks' NIXL registrations
        self.next_seq = 0
        self.unacked: set[int] = set()
        self.first_at: float | None = None
        self.discard = False  # the consumer said it reads no more
        self.lost: str | None = None
        self.changed = asyncio.Event()
        self.link: EdgeLink | None = None
        self.token = msg.stream_token
        assert msg.stream_to is not None and msg.to_stage is not None
        try:
            sock = connect(msg.stream_to)
        except (OSError, ValueError) as exc:
            self.lost = f"stage {msg.to_stage} is unreachable ({exc})"
            return
        self.link = EdgeLink(sock, hub.loop, self._on_message, self._on_lost)
        # Whatever closes the channel, nobody READs its chunks any more.
        self.link.on_closed = self._release_all
        if is_tcp(msg.stream_to):  # the token is the key: it never goes on the wire
            self.hello = EdgeHello(
                self.request_id, from_stage, msg.to_stage, "", window, new_nonce()
            )
            self.link.send(self.hello)
            self.link.await_seal()
        else:
            self.link.send(
                EdgeHello(self.request_id, from_stage, msg.to_stage, msg.stream_token, window)
            )

    def _on_message(self, msg: EdgeMessage) -> None:
        assert self.link is not None
        if isinstance(msg, EdgeNonce) and self.link.remote and self.link.seal is None:
            try:
                self.link.set_seal(FrameSeal(self.token, self.hello, msg.nonce, producer=True))
            except EdgeChannelError as exc:
                self._on_lost(str(exc))
            return
        if self.link.remote and self.link.seal is None:
            self._on_lost(f"{type(msg).__name__} before the handshake")
            return
        if isinstance(msg, EdgeCredit) and msg.seq in self.unacked:
            self.unacked.discard(msg.seq)
            if self.hub.nixl is not None:
                self.hub.nixl.release(self.channel, msg.seq)  # the consumer READ it
            self.hub.pulse()
        elif isinstance(msg, EdgeClose):
            self.discard = True
            self.unacked.clear()
            assert self.link is not None
            self.link.close()
        else:
            self._on_lost(f"unexpected {type(msg).__name__} from stage {self.to_stage}")
            return
        self.changed.set()

    def _on_lost(self, reason: str) -> None:
        if self.link is not None:
            self.link.close()
        self.lost = f"stage {self.to_stage}: {reason}"
        self.changed.set()

    def can_emit(self) -> bool:
        return self.lost is None and (self.discard or len(self.unacked) < self.window)

    async def emit(self, payload: Any) -> int:
        while not self.can_emit():
            async with _Waiting(self.hub.waits, self.request_id):
                if self.lost is not None:
                    await self.hub.peer_lost(self.request_id, self.lost)
                self.changed.clear()
                await self.changed.wait()
        seq = self.next_seq
        self.next_seq += 1
        if self.first_at is None:
            self.first_at = time.perf_counter()
        if self.discard:
            return seq
        assert self.link is not None
        try:
            self.link.send(EdgeChunk(seq, self._wire_payload(seq, payload)))
        except (EdgeChannelError, ConnectorError) as exc:
            self._on_lost(str(exc))
            raise StreamError(f"request {self.request_id}: {self.lost}") from None
        self.unacked.add(seq)
        self.hub.pulse()
        return seq

    def _wire_payload(self, seq: int, payload: Any) -> Any:
        """What chunk `seq` carries: over TCP, a tensor of at least the threshold as a NIXL
        descriptor (its registration held until its credit), else the payload inline."""
        link = self.link
        assert link is not None
        if not link.remote:
            return inline(payload)
        import torch

        threshold = self.hub.nixl_min_bytes
        if (
            threshold is not None
            and isinstance(payload, torch.Tensor)
            and payload.numel() * payload.element_size() >= threshold
        ):
            try:
                ref = self.hub.tensors().offer(self.channel, seq, payload)
            except ConnectorError as exc:
                ref = None
                self.hub.nixl_unusable(exc)
            if ref is not None:
                # Registered chunks are unacknowledged ones: the window bounds them.
                assert self.hub.tensors().held_by(self.channel) <= self.window
                edge_stats(self.from_stage, self.to_stage, "nixl").record_put(ref.nbytes)
                return ref
        value = inline(payload)
        size = len(value.data) if isinstance(value, InlineTensor) else len(value or b"")
        edge_stats(self.from_stage, self.to_stage, "inline").record_put(size)
        return value

    def _release_all(self) -> None:
        if self.hub.nixl is not None:
            self.hub.nixl.release_channel(self.channel)

    def held(self) -> int:
        """Chunks registered with NIXL for this channel now."""
        return 0 if self.hub.nixl is None else self.hub.nixl.held_by(self.channel)

    def finish(self) -> None:
        """The run returned: the end marker, then close once it left."""
        link = self.link
        if link is None or link.closed:
            return
        try:
            link.send(EdgeChunk(self.next_seq, end=True))
        except EdgeChannelError:
            pass
        link.close(flush=True)

    def drop(self) -> None:
        if self.link is not None:
            self.link.close()
        self.lost = self.lost or "aborted"
        self.changed.set()


class DirectInput:
    """A consumer's end of one request's edge: what arrived, in order, up to the window."""

    def __init__(self, hub: EdgeHub, request_id: str, from_stage: int, window: int, token: str):
        self.hub = hub
        self.request_id = request_id
        self.from_stage = from_stage
        self.window = window
        self.token = token
        self.claimed = False  # its Submit arrived (else the producer's connection came first)
        self.queue: deque[EdgeChunk] = deque()
        self.next_arrival = 0
        self.read_count = 0
        self.ended = False
        self.error: str | None = None  # the stream broke its contract: fails at once
        self.lost: str | None = None  # the producer vanished: wait for the Abort
        self.arrived = asyncio.Event()
        self.link: EdgeLink | None = None
        self.since = time.monotonic()
        # Chunks that came as NIXL descriptors: their READs, started as they arrive.
        self.fetches: dict[int, asyncio.Task] = {}
        # Over TCP: the connection's EdgeHello and our nonce, until the token seals it.
        self.hello: EdgeHello | None = None
        self.nonce = b""

    def attach(self, link: EdgeLink, hello: EdgeHello | None = None, nonce: bytes = b"") -> None:
        self.link = link
        self.hello, self.nonce = hello, nonce
        link.on_message = self._on_message
        link.on_lost = self._on_lost

    def seal(self) -> None:
        """Over TCP, once the token is known: verify the producer's frames from here on and
        read those held since its EdgeHello."""
        link = self.link
        if link is None or not link.remote or link.seal is not None or link.closed:
            return
        assert self.hello is not None
        try:
            link.set_seal(FrameSeal(self.token, self.hello, self.nonce, producer=False))
        except EdgeChannelError as exc:
            self._fail(str(exc))
            return
        link.release()

    def _on_message(self, msg: EdgeMessage) -> None:
        if not isinstance(msg, EdgeChunk):
            self._fail(f"unexpected {type(msg).__name__} from stage {self.from_stage}")
        elif msg.seq != self.next_arrival or self.ended:
            self._fail(
                f"chunk {msg.seq} from stage {self.from_stage}, expected {self.next_arrival}"
            )
        elif len(self.queue) >= self.window + 1:
            self._fail(f"stage {self.from_stage} sent past its window of {self.window}")
        else:
            self.queue.append(msg)
            if msg.end:
                self.ended = True
                assert self.link is not None
                if self.fetches:
                    # The producer holds what is still being READ until our end closes:
                    # read nothing more (not even its close), close once the READs ended.
                    self.link.hold()
                    self.hub.loop.create_task(self._close_after_fetches())
                else:
                    self.link.close()  # nothing more comes; credits no longer matter
            else:
                if isinstance(msg.payload, EdgeNixlTensor):
                    self.fetches[msg.seq] = self.hub.loop.create_task(self._fetch(msg.payload))
                self.next_arrival += 1
        self.arrived.set()

    async def _fetch(self, ref: EdgeNixlTensor) -> Any:
        stats = edge_stats(self.from_stage, self.hub.stage.stage_id, "nixl")
        return await asyncio.to_thread(self.hub.tensors().read, ref, stats)

    async def _close_after_fetches(self) -> None:
        tasks = list(self.fetches.values())
        if tasks:
            await asyncio.wait(tasks)
        if self.link is not None:
            self.link.close()

    def _drop_fetches(self) -> None:
        for task in self.fetches.values():
            if task.done() and not task.cancelled():
                task.exception()  # a failed READ nobody reads any more: no warning for it
            task.cancel()  # a READ under way ends by itself; its buffer is dropped
        self.fetches.clear()

    def _fail(self, why: str) -> None:
        self.error = f"request {self.request_id}: {why}"
        self.close()

    def _on_lost(self, reason: str) -> None:
        if not self.ended:
            self.lost = f"stage {self.from_stage}: {reason}"
            self.queue.clear()  # its producer is gone: the request cannot finish
            self._drop_fetches()
        if not self.claimed:
            self.hub.forget_unclaimed(self)
        self.arrived.set()

    async def read(self) -> AsyncIterator[Any]:
        while True:
            if self.error is not None:
                raise StreamError(self.error)
            if not self.queue:
                async with _Waiting(self.hub.waits, self.request_id):
                    if self.lost is not None:
                        await self.hub.peer_lost(self.request_id, self.lost)
                    self.arrived.clear()
                    await self.arrived.wait()
                continue
            chunk = self.queue.popleft()
            if chunk.end:
                return
            payload = chunk.payload
            if isinstance(payload, EdgeNixlTensor):
                value = await self._fetched(chunk.seq)
            elif isinstance(payload, InlineTensor):
                value = from_inline(payload)
            else:
                value = payload
            chunk.payload = None  # the consumer holds the only reference from here
            del payload
            self.read_count += 1
            yield value
            del value
            link = self.link
            if link is not None and not link.closed:
                link.send(EdgeCredit(chunk.seq))  # it asked for the next one: done with this
            self.hub.pulse()

    async def _fetched(self, seq: int) -> Any:
        """Chunk `seq`'s tensor once its READ ended (a wait on the peer's memory)."""
        task = self.fetches[seq]
        if not task.done():
            async with _Waiting(self.hub.waits, self.request_id):
                await asyncio.wait([task])  # our cancellation leaves the READ alone
        del self.fetches[seq]
        exc = task.exception()
        if exc is not None:
            self.error = (
                f"request {self.request_id}: the NIXL read of chunk {seq} from stage "
                f"{self.from_stage} failed: {exc}"
            )
            self.close()
            raise StreamUnavailable(self.error)
        return task.result()

    def waiting(self) -> int:
        return len(self.queue)

    def finish(self) -> None:
        """The run returned: tell a producer still sending that nobody reads, and close."""
        link = self.link
        if link is not None and not link.closed and not self.ended:
            try:
                link.send(EdgeClose())
            except EdgeChannelError:
                pass
            link.close(flush=True)
        self.queue.clear()
        self._drop_fetches()

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.queue.clear()
        self._drop_fetches()
        self.arrived.set()


class EdgeHub:
    """A stage process's streamed edges to and from other stages: its listeners (local, and
    TCP on a headless node), and the connections that arrived before their request's Submit."""

    def __init__(self, stage: Any, name_hint: str, nixl_min_bytes: int | None = None):
        self.stage = stage
        self.name_hint = name_hint
        # Over TCP, tensor chunks of at least this many bytes go through NIXL (None: never).
        self.nixl_min_bytes = nixl_min_bytes
        self.nixl: EdgeNixl | None = None  # created with the first chunk that uses it
        self._channels = 0
        self.listener = EdgeListener(name_hint)
        tcp_host = os.environ.get(EDGE_TCP_HOST_ENV)
        self.tcp_listener = EdgeListener(name_hint, tcp_host=tcp_host) if tcp_host else None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set in start
        self.waits: Waits = None  # type: ignore[assignment]
        self.unclaimed: dict[tuple[str, int], DirectInput] = {}

    @property
    def address(self) -> str:
        return self.listener.address

    @property
    def tcp_address(self) -> str | None:
        """Where producers on other nodes connect (None: this stage is not on a node)."""
        return None if self.tcp_listener is None else self.tcp_listener.address

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.waits = Waits(loop, self._report_wait)
        self.listener.start(loop, self._accepted)
        if self.tcp_listener is not None:
            self.tcp_listener.start(loop, self._accepted)

    def pulse(self) -> None:
        self.stage.pulse()

    def tensors(self) -> EdgeNixl:
        if self.nixl is None:
            self.nixl = EdgeNixl(self.name_hint)
        return self.nixl

    def nixl_unusable(self, exc: ConnectorError) -> None:
        """NIXL refused a chunk (not installed, no backend, memory it cannot register): this
        stage's chunks go inline from now on, as a frame holds them."""
        logger.warning(
            "stage %s: streamed chunks across nodes go inline: NIXL is unusable here (%s)",
            self.stage.stage_id,
            exc,
        )
        self.nixl_min_bytes = None

    def new_channel(self, request_id: str) -> tuple[str, int]:
        self._channels += 1
        return (request_id, self._channels)

    def nixl_held(self) -> dict[str, int]:
        """Request id -> its output chunks registered with NIXL now (also of a request whose
        run ended and whose channel still drains)."""
        counts: dict[str, int] = {}
        for (rid, _), _seq in self.nixl.held if self.nixl is not None else ():
            counts[rid] = counts.get(rid, 0) + 1
        return counts

    def _report_wait(self, rid: str, waiting: bool) -> None:
        self.stage.reply(StreamWait(rid, self.stage.stage_id, waiting))

    async def peer_lost(self, rid: str, why: str) -> None:
        """Wait for the Abort that follows a lost peer (this task is cancelled then)."""
        await asyncio.sleep(PEER_LOST_GRACE_S)
        raise StreamError(f"request {rid}: {why}, and no abort followed")

    # ---- the consumer's side: connections from producers -----------------------------------
    def _accepted(self, sock: socket.socket) -> None:
        pending: dict[str, Any] = {}

        def hello(msg: EdgeMessage) -> None:
            pending["timer"].cancel()
            if not isinstance(msg, EdgeHello) or msg.to_stage != self.stage.stage_id:
                link.close()
                return
            self._on_hello(link, msg)

        def lost(_reason: str) -> None:
            pending["timer"].cancel()

        link = EdgeLink(sock, self.loop, hello, lost)
        pending["timer"] = self.loop.call_later(HELLO_TIMEOUT_S, link.close)

    def _on_hello(self, link: EdgeLink, hello: EdgeHello) -> None:
        nonce = b""
        if link.remote:
            # Our half of the key, then nothing more is read until the token is known.
            nonce = new_nonce()
            try:
                link.send(EdgeNonce(nonce))
            except EdgeChannelError:
                link.close()
                return
            link.hold()
        key = (hello.request_id, hello.from_stage)
        inp = self.stage.streams.inputs.get(key)
        if inp is not None:
            if inp.link is not None or (
                not link.remote and not hmac.compare_digest(inp.token, hello.token)
            ):
                link.close()
                return
            inp.attach(link, hello, nonce)
            inp.seal()
            return
        if key in self.unclaimed or len(self.unclaimed) >= MAX_UNCLAIMED:
            link.close()
            return
        window = min(max(hello.window, 1), MAX_UNCLAIMED_WINDOW)  # until its Submit says
        inp = DirectInput(self, hello.request_id, hello.from_stage, window, hello.token)
        inp.attach(link, hello, nonce)
        self.unclaimed[key] = inp
        if link.remote:  # a connection whose Submit never comes is not kept
            self.loop.call_later(HELLO_TIMEOUT_S, self._expire, key, inp)

    def _expire(self, key: tuple[str, int], inp: DirectInput) -> None:
        if self.unclaimed.get(key) is inp:
            del self.unclaimed[key]
            inp.close()

    def claim(self, request_id: str, from_stage: int, window: int, token: str) -> DirectInput:
        """The input of a Submit: the connection that came first, if its token matches (over
        TCP: if its frames verify under the token)."""
        inp = self.unclaimed.pop((request_id, from_stage), None)
        if inp is not None and inp.link is not None and inp.link.remote:
            inp.token = token
            inp.seal()
        elif inp is not None and not hmac.compare_digest(inp.token, token):
            inp.close()
            inp = None
        if inp is None:
            inp = DirectInput(self, request_id, from_stage, window, token)
        inp.claimed = True
        inp.window = window
        if len(inp.queue) > window + 1:
            inp._fail(f"stage {from_stage} sent past its window of {window}")
        return inp

    def forget_unclaimed(self, inp: DirectInput) -> None:
        key = (inp.request_id, inp.from_stage)
        if self.unclaimed.get(key) is inp:
            del self.unclaimed[key]

    def drop(self, request_id: str) -> None:
        for key in [k for k in self.unclaimed if k[0] == request_id]:
            self.unclaimed.pop(key).close()
        if self.waits is not None:
            self.waits.forget(request_id)

    def close(self) -> None:
        for inp in self.unclaimed.values():
            inp.close()
        self.unclaimed.clear()
        self.listener.close()
        if self.tcp_listener is not None:
            self.tcp_listener.close()
        if self.nixl is not None:
            self.nixl.close()
