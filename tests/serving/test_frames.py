"""frames.FrameReader decodes what a stage's MessageChannel sends (msgpack of the message
schema in multiprocessing.connection framing), whole frames only, however the bytes are split
across reads, and reports EOF; FrameWriter writes what the channel reads without ever blocking
its event loop. A frame outside the schema (a pickle, say) is refused, never loaded."""

from __future__ import annotations

import asyncio
import os
import pickle
import select
import socket
import threading
import time
from multiprocessing.connection import Connection

import msgspec
import pytest

from vllm_omni_plugin.common.channel import MessageChannel
from vllm_omni_plugin.common.messages import Inspect, Pulse, Result, decode_from_stage, encode
from vllm_omni_plugin.orchestrator.frames import FrameReader, FrameWriter, encode_frame


def test_frames_across_split_reads_and_eof():
    ours, theirs = socket.socketpair()
    sender = MessageChannel(Connection(theirs.detach()))
    reader = FrameReader(ours.fileno())
    big = Result("r2", output=[bytes(range(256)) * 20_000])  # 5 MB: many reads
    messages = [Result("r1", output=[b"png"], stage_s=0.5), big, Pulse(3)]

    def send() -> None:
        for msg in messages:
            sender.send(msg)
        sender.close()

    threading.Thread(target=send, daemon=True).start()
    got, reads, eof = [], 0, False
    while not eof:
        select.select([ours], [], [], 10)
        out = reader.read()
        reads += 1
        if out is None:
            eof = True
        else:
            got.extend(out)
    assert reads > len(messages)  # the 5 MB frame arrived in pieces
    assert [m.request_id for m in got[:2]] == ["r1", "r2"] and got[0].stage_s == 0.5
    assert got[1].output == big.output and got[2] == messages[2]
    ours.close()


def test_writer_never_blocks_on_a_peer_that_is_not_reading():
    ours, theirs = socket.socketpair()
    receiver = MessageChannel(Connection(theirs.detach()), decode_from_stage)
    os.set_blocking(ours.fileno(), False)
    big = Result("big", output=[bytes(range(256)) * 32_768])  # 8 MB: far above the socket buffer

    async def send_all() -> list:
        loop = asyncio.get_running_loop()
        writer = FrameWriter(loop, ours.fileno())
        t0 = time.perf_counter()
        for msg in (Result("a"), big, Result("b")):
            writer.write(encode_frame(msg))  # a blocking send would wait for the reader forever
        assert time.perf_counter() - t0 < 1.0
        assert writer._unsent  # the rest waits for the peer, in order
        return await loop.run_in_executor(None, lambda: [receiver.recv() for _ in range(3)])

    got = asyncio.run(send_all())
    assert [m.request_id for m in got] == ["a", "big", "b"] and got[1].output == big.output
    frame = encode_frame(big)  # encoded in place behind its length, as send_bytes frames it
    assert frame[4:] == encode(big) and int.from_bytes(frame[:4], "big") == len(frame) - 4
    ours.close()
    receiver.close()


def test_a_frame_outside_the_schema_is_refused_not_loaded(tmp_path):
    """A pickled frame (what this socket carried before) is a decode error: nothing runs."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    ours, theirs = socket.socketpair()
    sender = Connection(theirs.detach())
    sender.send_bytes(pickle.dumps(Evil()))
    sender.send_bytes(msgspec.msgpack.encode(Inspect(1)))  # valid msgpack, wrong direction
    reader = FrameReader(ours.fileno())
    select.select([ours], [], [], 10)
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        reader.read()
    assert not marker.exists()
    ours.close()
    sender.close()
