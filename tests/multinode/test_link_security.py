"""The node registry is safe by default: real sockets, a real StageHead, no stage processes.

* Only a peer holding the key gets past the handshake, in both directions.
* Nothing on the link is unpickled: a pickle whose unpickling would create a file, sent before
  or after authenticating, never creates it; the connection is dropped and the head serves on.
* Beyond loopback the registry does not listen (and a node does not connect) without
  VLLM_OMNI_AUTHKEY, and says so naming the variable; `vllm serve` refuses to start.
* Sending never blocks on the socket: a peer that stops reading cannot stall the caller.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time
from argparse import Namespace
from pathlib import Path

import msgspec
import pytest
import torch
from free_ports import free_port
from link_peers import (
    DIT,
    KEY,
    cfg,
    closed_by_peer,
    dit_info,
    in_thread,
    register,
    running_head,
    until,
)

from vllm_omni_plugin.common.link_messages import (
    Heartbeat,
    Register,
    StageStatus,
    Welcome,
    decode_link,
)
from vllm_omni_plugin.common.messages import Result
from vllm_omni_plugin.common.payload import InlineTensor, Via
from vllm_omni_plugin.connectors.base import PayloadDescriptor
from vllm_omni_plugin.orchestrator import link as link_mod
from vllm_omni_plugin.orchestrator import remote
from vllm_omni_plugin.orchestrator.link import (
    MAGIC,
    AuthenticationError,
    Link,
    Session,
    accept,
    connect,
    frame_mac,
)
from vllm_omni_plugin.orchestrator.node import shutdown_concurrently, stage_init
from vllm_omni_plugin.orchestrator.node_protocol import (
    AUTHKEY_ENV,
    authkey,
    is_loopback,
)
from vllm_omni_plugin.orchestrator.stage_process import stage_env
from vllm_omni_plugin.stages.payloads import from_inline, inline

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
async def head():
    async with running_head() as started:
        yield started


class _Marker:
    """Unpickling this creates `path` (what an attacker's payload would do, harmlessly)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def evil_pickle(path: Path) -> bytes:
    return pickle.dumps(_Marker(path), protocol=pickle.HIGHEST_PROTOCOL)


def test_the_crafted_pickle_really_would_run(tmp_path):
    """Guards the tests below: their payload does create its file when unpickled."""
    probe = tmp_path / "probe"
    pickle.loads(evil_pickle(probe)).close()
    assert probe.exists()


# ---- authentication ----------------------------------------------------------------------
async def test_wrong_key_is_rejected_and_the_head_serves_on(head):
    h, client = head
    with pytest.raises(AuthenticationError, match=AUTHKEY_ENV):
        await register(h.port, key=b"not the key")
    assert not client.ready
    link, reply = await register(h.port)  # the right key still registers
    assert isinstance(reply, Welcome)
    link.close()


async def test_a_wrong_key_cannot_replace_a_live_node(head):
    h, client = head
    live, reply = await register(h.port, node="live")
    assert isinstance(reply, Welcome)
    await until(lambda: client.ready)
    for bad in (b"not the key", KEY[:-1] + b"!"):
        with pytest.raises(AuthenticationError):
            await register(h.port, key=bad, node="intruder")
    assert client.ready and client.link.peer.startswith("live") and client.deaths == 0
    live.close()


async def test_a_head_without_the_key_is_not_trusted_by_the_node():
    """An impostor head that cannot prove the key: the node's connect() refuses it."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def impostor() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(MAGIC + os.urandom(32))
            conn.recv(1024)  # the node's greeting and MAC
            conn.sendall(os.urandom(32))  # a made-up proof

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    try:
        with pytest.raises(AuthenticationError, match="could not prove"):
            await in_thread(connect, "127.0.0.1", port, KEY, 5.0)
    finally:
        t.join(5)
        server.close()


async def test_handshake_with_the_same_key_on_both_sides():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    results: list = []

    def head_side() -> None:
        conn, _ = server.accept()
        try:
            results.append(accept(conn, KEY, 5.0))
        except Exception as exc:
            results.append(exc)
            conn.close()

    t = threading.Thread(target=head_side, daemon=True)
    t.start()
    node = await in_thread(connect, "127.0.0.1", port, KEY, 5.0)
    t.join(5)
    server.close()
    head_side_session = results[0]
    assert isinstance(head_side_session, Session)
    # One key per direction, and each side sends under the key the other receives with.
    assert head_side_session.send_key == node.recv_key != node.send_key
    assert head_side_session.recv_key == node.send_key
    head_side_session.sock.close()
    node.sock.close()


# ---- no code execution -------------------------------------------------------------------
@pytest.mark.parametrize("framing", ["raw", "mp-connection"])
async def test_pickle_before_authentication_is_not_executed(head, tmp_path, framing):
    h, client = head
    marker = tmp_path / "pwned"
    payload = evil_pickle(marker)
    if framing == "mp-connection":  # what the old pickled link (multiprocessing) would read
        payload = struct.pack("!i", len(payload)) + payload
    sock = socket.create_connection(("127.0.0.1", h.port), timeout=5)
    try:
        sock.sendall(payload)
        assert await in_thread(closed_by_peer, sock), "the head kept the connection"
    finally:
        sock.close()
    await asyncio.sleep(0.2)
    assert not marker.exists()
    link, reply = await register(h.port)  # the registry still serves
    assert isinstance(reply, Welcome)
    link.close()


async def test_pickle_with_the_right_key_is_not_executed(head, tmp_path):
    """A leaked key is not code execution: after authenticating, a pickled frame (instead of
    Register, and later instead of a Heartbeat) only gets the connection dropped."""
    h, client = head
    marker = tmp_path / "pwned"
    frame = struct.pack(">I", len(evil_pickle(marker))) + evil_pickle(marker)

    session = await in_thread(connect, "127.0.0.1", h.port, KEY, 5.0)
    sock = session.sock
    sock.sendall(frame + frame_mac(session.send_key, 0, frame))  # instead of Register
    assert await in_thread(closed_by_peer, sock)
    sock.close()
    assert not marker.exists() and not client.ready

    link, reply = await register(h.port)  # registered: the head's reader thread now reads
    assert isinstance(reply, Welcome)
    for _ in range(100):
        if client.ready:
            break
        await asyncio.sleep(0.02)
    assert client.ready
    # Behind the Link's back, as a hostile node holding the key would (a valid MAC: this
    # tests the decoder, not the MAC).
    link.sock.sendall(frame + frame_mac(link._send_key, link._send_seq, frame))
    for _ in range(150):
        if client.deaths:  # the loop heard the drop (ready turns False a moment earlier)
            break
        await asyncio.sleep(0.02)
    assert not client.ready and client.deaths == 1  # dropped like a dead node
    assert not marker.exists()
    link.close()


async def test_unknown_message_types_are_rejected(head):
    h, client = head
    link, _ = await register(h.port)
    for _ in range(100):
        if client.ready:
            break
        await asyncio.sleep(0.02)
    # Well-formed msgpack, plausible shape, a tag the protocol does not have.
    data = msgspec.msgpack.encode({"type": "RunShell", "cmd": "touch /tmp/x"})
    frame = struct.pack(">I", len(data)) + data
    link.sock.sendall(frame + frame_mac(link._send_key, link._send_seq, frame))
    for _ in range(150):
        if client.deaths:
            break
        await asyncio.sleep(0.02)
    assert not client.ready and client.deaths == 1
    link.close()


# ---- listening beyond loopback -----------------------------------------------------------
def head_args(address: str | None) -> Namespace:
    return Namespace(stage_ids="0", omni_master_port=0, omni_master_address=address)


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "10.1.2.3"])
def test_non_loopback_bind_without_the_key_is_refused(monkeypatch, address):
    monkeypatch.delenv(AUTHKEY_ENV, raising=False)
    with pytest.raises(SystemExit, match=AUTHKEY_ENV) as err:
        remote.head_from_args(cfg(), head_args(address))
    assert address in str(err.value)


def test_a_node_without_the_key_refuses_a_remote_head(monkeypatch):
    monkeypatch.delenv(AUTHKEY_ENV, raising=False)
    with pytest.raises(SystemExit, match=AUTHKEY_ENV):
        authkey(cfg(), "10.1.2.3", "node")
    assert authkey(cfg(), "127.0.0.1", "node") == authkey(cfg(), "localhost", "head")


def test_stage_processes_do_not_inherit_the_key(monkeypatch):
    monkeypatch.setenv(AUTHKEY_ENV, "s3cret")
    env = stage_env(Namespace(devices="1", env={"FOO": "bar"}))
    assert AUTHKEY_ENV not in env  # only the head and node processes hold the secret
    assert (env["CUDA_VISIBLE_DEVICES"], env["FOO"]) == ("1", "bar")


async def test_a_head_built_by_hand_does_not_listen_beyond_loopback_unkeyed(monkeypatch):
    monkeypatch.delenv(AUTHKEY_ENV, raising=False)
    h = remote.StageHead(KEY, 0, "0.0.0.0")
    with pytest.raises(SystemExit, match=AUTHKEY_ENV):
        await h.start()
    assert h._sock is None  # nothing was bound


async def test_default_is_loopback_and_works_without_a_key(monkeypatch):
    monkeypatch.delenv(AUTHKEY_ENV, raising=False)
    h = remote.head_from_args(cfg(), head_args(None))
    assert h is not None and h.bind == "127.0.0.1" and is_loopback(h.bind)
    h.client_for(stage_init(cfg(), 1))
    await h.start()
    try:
        key = authkey(cfg(), "127.0.0.1", "node")  # what a node on this host derives
        sock = await in_thread(connect, "127.0.0.1", h.port, key, 5.0)
        link = Link(sock, "head")
        link.send(Register("n", "host", 1, DIT))
        assert isinstance(await in_thread(link.recv, 5.0), Welcome)
        link.close()
    finally:
        h.close()


async def test_with_the_key_the_registry_listens_on_all_interfaces(monkeypatch):
    monkeypatch.setenv(AUTHKEY_ENV, "a shared secret of at least 32 bytes")
    h = remote.head_from_args(cfg(), head_args("0.0.0.0"))
    h.client_for(stage_init(cfg(), 1))
    await h.start()
    try:
        assert h._sock.getsockname()[0] == "0.0.0.0"
        link, reply = await register(h.port, key=b"a shared secret of at least 32 bytes")
        assert isinstance(reply, Welcome)
        link.close()
    finally:
        h.close()


def test_vllm_serve_refuses_a_non_loopback_registry_without_the_key(tmp_path):
    """The acceptance line: `vllm serve ... --stage-ids 0 --omni-master-address 0.0.0.0`."""
    master = free_port()
    env = {k: v for k, v in os.environ.items() if k not in (AUTHKEY_ENV, "VLLM_PLUGINS")}
    vllm = str(Path(sys.executable).parent / "vllm")
    args = ["serve", "/unused/glm-image", "--stage-config", "glm_image_tiny_nixl"]
    args += ["--stage-ids", "0", "--omni-master-address", "0.0.0.0"]
    args += ["--omni-master-port", str(master), "--port", "0"]
    t0 = time.monotonic()
    out = subprocess.run(
        [vllm, *args], capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    assert AUTHKEY_ENV in text and "0.0.0.0" in text, text[-3000:]
    assert "not a loopback address" in text, text[-3000:]
    print(f"refused in {time.monotonic() - t0:.1f} s")


# ---- no blocking writes --------------------------------------------------------------------
async def test_send_never_blocks_on_a_peer_that_stops_reading(monkeypatch):
    server = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(server.getsockname())  # never reads
    ours, _ = server.accept()
    server.close()
    link = Link(Session(ours, KEY, KEY), "stalled peer")
    lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    link.start_reader(
        asyncio.get_running_loop(), lambda *_: None, lambda _l, why: lost.set_result(why)
    )
    blob = Result("big", output=[b"x" * (1 << 20)])
    t0 = time.monotonic()
    for _ in range(48):  # far more than the kernel's socket buffers hold
        link.send(blob)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0, f"send() blocked for {elapsed:.1f} s"
    assert link._queued > 8 << 20  # most of it is waiting for the writer thread

    # No room for more: below what is still queued. Not `link._queued` itself: the writer
    # thread may drain a frame's worth into the kernel between that read and the next send
    # (seen once in make test).
    monkeypatch.setattr(link_mod, "MAX_QUEUED_BYTES", 8 << 20)
    with pytest.raises(BrokenPipeError):
        link.send(blob)
    assert "not reading" in await asyncio.wait_for(lost, 5)
    assert not link.alive
    peer.close()


def test_node_stops_its_stages_concurrently():
    class SlowStage:
        def __init__(self, i: int):
            self.stage_id = i
            self.stopped = False

        def shutdown(self) -> None:
            time.sleep(1.0)  # a stage process taking its time to exit
            self.stopped = True

    stages = [SlowStage(i) for i in range(3)]
    t0 = time.monotonic()
    shutdown_concurrently(stages)
    assert all(s.stopped for s in stages) and time.monotonic() - t0 < 2.0


# ---- values on the link: typed, explicit ---------------------------------------------------
def through_the_wire(value):
    """`value` as a stage's Result output, across the link's encoding, read back."""
    got = decode_link(link_mod.encode(Result("r", output=inline(value)))[4:]).output
    return from_inline(got) if isinstance(got, InlineTensor) else got


def test_descriptors_and_inline_tensors_round_trip_typed():
    from vllm_omni_plugin.connectors.nixl import NixlLocation

    loc = NixlLocation("agent", "inc", b"\x00md", None, 4096, 128, 0, "DRAM", 7)
    desc = PayloadDescriptor("nixl", "nixl", "k", "r", 0, 1, "tensor", "int64", (4,), 32, 9.0, loc)
    back = through_the_wire(Via("nixl", desc))
    assert back.connector == "nixl" and back.desc == desc and back.desc.location == loc

    tensors = (torch.arange(12).reshape(3, 4), torch.ones(2, dtype=torch.bfloat16), torch.tensor(5))
    for t in (*tensors, torch.empty(0, 3)):
        back = through_the_wire(t)
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
    assert through_the_wire([b"png"]) == [b"png"] and through_the_wire(None) is None
    with pytest.raises(TypeError, match="connector"):
        inline({"a": object()})


def test_stage_info_crosses_the_link_typed():
    """A stage's Ready info rides the heartbeats as the typed StageInfo, limits included."""
    info = dit_info(max_steps=9)
    frame = link_mod.encode(Heartbeat({1: StageStatus("diffusion", True, info)}))
    back = msgspec.msgpack.decode(frame[4:], type=Heartbeat).stages[1].info
    assert back == info and back.limits.max_steps == 9


# ---- the key ---------------------------------------------------------------------------------
def test_a_key_shorter_than_32_bytes_is_refused(monkeypatch):
    monkeypatch.setenv(AUTHKEY_ENV, "x" * 31)
    with pytest.raises(SystemExit, match="at least 32"):
        authkey(cfg(), "127.0.0.1", "head")
    monkeypatch.setenv(AUTHKEY_ENV, "x" * 32)
    assert authkey(cfg(), "0.0.0.0", "head") == b"x" * 32


def test_the_same_host_key_is_random_private_and_shared(monkeypatch, tmp_path):
    import hashlib

    monkeypatch.delenv(AUTHKEY_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    head = authkey(cfg(), "127.0.0.1", "head")
    assert authkey(cfg(), "localhost", "node") == head  # what a node of this user reads
    path = tmp_path / "vllm-omni" / "node_link_key"
    assert path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "vllm-omni").stat().st_mode & 0o777 == 0o700
    assert len(head) == 64 and head == path.read_bytes()
    # Nothing public gives it: not the pipeline's shape (what an older version derived the key from).
    shape = ",".join(f"{s.stage_id}:{s.kind}:{sorted(s.inputs)}" for s in cfg().topology.stages)
    derived = hashlib.sha256(f"vllm-omni-plugin/{cfg().pipeline}/{shape}".encode()).digest()
    assert head != derived
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(other))
    assert authkey(cfg(), "127.0.0.1", "head") != head  # another user's folder, another key


def test_a_loose_or_linked_key_file_is_refused(monkeypatch, tmp_path):
    monkeypatch.delenv(AUTHKEY_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    authkey(cfg(), "127.0.0.1", "head")
    path = tmp_path / "vllm-omni" / "node_link_key"
    path.chmod(0o644)
    with pytest.raises(SystemExit, match="readable by others"):
        authkey(cfg(), "127.0.0.1", "node")
    path.unlink()
    planted = tmp_path / "planted"
    planted.write_text("0" * 64)
    planted.chmod(0o600)
    path.symlink_to(planted)
    with pytest.raises((SystemExit, OSError)):
        authkey(cfg(), "127.0.0.1", "node")


async def test_a_node_with_the_derived_key_is_refused(monkeypatch, tmp_path):
    import hashlib

    monkeypatch.delenv(AUTHKEY_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    h = remote.head_from_args(cfg(), head_args(None))
    h.client_for(stage_init(cfg(), 1))
    await h.start()
    try:
        shape = ",".join(f"{s.stage_id}:{s.kind}:{sorted(s.inputs)}" for s in cfg().topology.stages)
        derived = hashlib.sha256(f"vllm-omni-plugin/{cfg().pipeline}/{shape}".encode()).digest()
        with pytest.raises((AuthenticationError, ConnectionError, OSError)):
            await register(h.port, key=derived)
    finally:
        h.close()
