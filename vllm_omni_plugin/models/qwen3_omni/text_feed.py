"""The thinker's text, streamed from the talker stage into the talker's vLLM worker.

The talker's input at frame step k carries the thinker's generated token k + 1 (prompt.py),
and the thinker is still writing while the talker speaks. vLLM gives a running request no stock
per-step input, so the stage pushes each request's text ids over a ZMQ socket of its own
(`TextSender`, bound in the stage process) and the worker's runner reads them (`TextFeed`) before
each step: a request keyed by `SamplingParams.extra_args[TEXT_STREAM]` takes its entries from
the feed. A step whose request needs an id the thinker has not written yet waits for it (the
thinker is usually ahead: it writes a token per step, the talker a frame per step); `final`
says the text is complete, so the talker closes the speech with `tts_eos` and then `tts_pad`.
A request the stage dropped (an abort, a failure) is `closed`: its text counts as complete, so
no step waits on it while vLLM removes it.

One sender per stage, one worker per talker engine (the talker runs on one device).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

logger = logging.getLogger("vllm_omni_plugin.models.qwen3_omni.text_feed")

TEXT_STREAM = "talker_text_stream"  # SamplingParams.extra_args key: the request's feed key
# The engine's additional_config key holding {"endpoint": ...} for the worker.
ADDITIONAL_CONFIG_KEY = "omni_talker_text"
# A step waits this long at most for text the thinker has not written; past it the request's
# text counts as complete (the thinker's stage has its own watchdog: a stall this long means
# its text will not come).
MAX_TEXT_WAIT_S = 30.0
_CLOSED_KEPT = 4096  # closed keys remembered (a close may reach the worker before the request)
# Messages the stage may have sent that the worker has not read (a send past it fails its
# request: the worker is stuck). A request sends one per thinker chunk.
MAX_UNREAD_MESSAGES = 100_000


class TextMessage(msgspec.Struct, array_like=True):
    key: str
    ids: list[int] = []
    final: bool = False  # the thinker's text is complete after `ids`
    closed: bool = False  # the stage dropped the request: forget it


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(TextMessage).decode


class TextSender:
    """The stage's end: a PUSH socket on an ipc path only this user can reach."""

    def __init__(self) -> None:
        import zmq

        self._dir = tempfile.mkdtemp(prefix="omni-talker-text-")
        os.chmod(self._dir, 0o700)
        self.endpoint = f"ipc://{self._dir}/{uuid.uuid4().hex[:12]}.sock"
        self._sock = zmq.Context.instance().socket(zmq.PUSH)  # shared: see TextFeed
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, MAX_UNREAD_MESSAGES)
        self._sock.bind(self.endpoint)

    def send(self, key: str, ids: list[int], final: bool = False) -> None:
        self._send(TextMessage(key, ids, final))

    def close_request(self, key: str) -> None:
        self._send(TextMessage(key, closed=True))

    def _send(self, msg: TextMessage) -> None:
        # Never blocks the stage's event loop. The worker connects when its engine starts,
        # before any request: with no reader (a dead worker) or a full queue, this fails.
        import zmq

        try:
            self._sock.send(_encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            raise RuntimeError("the talker's engine is not reading the thinker's text") from None

    def close(self) -> None:
        self._sock.close(0)
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)


@dataclass
class _Text:
    ids: list[int] = field(default_factory=list)
    final: bool = False


class TextFeed:
    """The worker's end: each open request's text ids so far, read from the socket."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._zmq = zmq
        # The process's shared context, which is never garbage: nothing closes a feed (it lives
        # as long as its model), and a context of its own, collected in the same cycle as its
        # socket, would block the collection in pyzmq's finalizer (the context's termination
        # waits for a socket that only a later finalizer closes).
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._texts: dict[str, _Text] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()

    def _take(self, msg: TextMessage) -> None:
        if msg.closed:
            self._texts.pop(msg.key, None)
            self._closed[msg.key] = None
            while len(self._closed) > _CLOSED_KEPT:
                self._closed.popitem(last=False)
            return
        if msg.key in self._closed:
            return
        text = self._texts.setdefault(msg.key, _Text())
        text.ids.extend(msg.ids)
        text.final = text.final or msg.final

    def _drain(self, timeout_ms: int) -> None:
        """Read every message waiting; wait up to `timeout_ms` for the first one."""
        if timeout_ms and not self._sock.poll(timeout_ms):
            return
        while True:
            try:
                raw = self._sock.recv(self._zmq.NOBLOCK)
            except self._zmq.Again:
                return
            self._take(_decode(raw))

    def _known(self, key: str, index: int) -> bool:
        if key in self._closed:
            return True
        text = self._texts.get(key)
        return text is not None and (text.final or index < len(text.ids))

    def wait_for(self, needs: dict[str, int]) -> None:
        """Return once every request key in `needs` has text id `needs[key]`, or complete text
        (at most MAX_TEXT_WAIT_S: past it, the missing ones count as complete)."""
        self._drain(0)
        deadline = time.monotonic() + MAX_TEXT_WAIT_S
        while missing := [k for k, i in needs.items() if not self._known(k, i)]:
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning(
                    "no thinker text for %s in %.0f s: closing", missing, MAX_TEXT_WAIT_S
                )
                for key in missing:
                    self._texts.setdefault(key, _Text()).final = True
                return
            self._drain(max(1, int(min(left, 0.5) * 1000)))

    def entry(self, key: str, index: int) -> int | None:
        """Text id `index` of the request, or None past its end (wait_for first)."""
        text = self._texts.get(key)
        if text is None or index >= len(text.ids):
            return None
        return text.ids[index]

    def length(self, key: str) -> int:
        text = self._texts.get(key)
        return 0 if text is None else len(text.ids)

    def forget(self, key: str) -> None:
        self._texts.pop(key, None)

    def close(self) -> None:
        self._sock.close(0)
