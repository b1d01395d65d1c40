"""frames.FrameReader decodes what multiprocessing.connection.Connection sends, whole frames only,
however the bytes are split across reads, and reports EOF."""

from __future__ import annotations

import select
import socket
import threading
from multiprocessing.connection import Connection

from vllm_omni_plugin.orchestrator.frames import FrameReader
from vllm_omni_plugin.stages.messages import Result


def test_frames_across_split_reads_and_eof():
    ours, theirs = socket.socketpair()
    sender = Connection(theirs.detach())
    reader = FrameReader(ours.fileno())
    big = Result("r2", output=[bytes(range(256)) * 20_000])  # 5 MB: many reads
    messages = [Result("r1", output=[b"png"], stage_s=0.5), big, {"k": "v" * 20_000}]

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
