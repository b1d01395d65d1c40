"""Shared by the link's security tests: a real StageHead on loopback and a node's first steps."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

from vllm_omni_plugin.common.limits import RequestLimits
from vllm_omni_plugin.common.link_messages import Register, StageStatus
from vllm_omni_plugin.common.messages import DiffusionSettings, StageInfo
from vllm_omni_plugin.config import load_deploy_config
from vllm_omni_plugin.orchestrator import remote
from vllm_omni_plugin.orchestrator.link import Link, connect
from vllm_omni_plugin.orchestrator.node import stage_init

KEY = b"link-security-test-key"


def dit_info(**limits: int) -> StageInfo:
    """A diffusion stage's Ready info as a node relays it (settings: plain placeholders)."""
    settings = DiffusionSettings({}, "cpu", "torch.float32", None, 1, 0.0, None, None, 1, None)
    bounds = RequestLimits(16, 64, 64, 1024, 1024, 50, 4, 512, 512)
    return StageInfo("diffusion", settings, limits=RequestLimits(**{**bounds.to_dict(), **limits}))


DIT = {1: StageStatus("diffusion", True, dit_info(), pid=4242)}


def cfg():
    return load_deploy_config("glm_image_tiny_nixl", model="/unused/glm-image")


@contextlib.asynccontextmanager
async def running_head():
    """A StageHead on 127.0.0.1 (any port) running stage 0 itself, stage 1 remote: (head,
    stage 1's RemoteStageClient)."""
    h = remote.StageHead(KEY, 0, "127.0.0.1")
    h.local_ids = [0]
    client = h.client_for(stage_init(cfg(), 1))
    await h.start()
    try:
        yield h, client
    finally:
        h.close()


async def in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def register(port: int, key: bytes = KEY, node: str = "n1") -> tuple[Link, object]:
    session = await in_thread(connect, "127.0.0.1", port, key, 5.0)
    link = Link(session, "head")
    link.send(Register(node, "host", 1, DIT))
    return link, await in_thread(link.recv, 5.0)


def closed_by_peer(sock: socket.socket, timeout: float = 3.0) -> bool:
    """True when the peer closes within `timeout` (whatever it sent before is discarded)."""
    sock.settimeout(timeout)
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


async def until(predicate, timeout: float = 5.0) -> None:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        await asyncio.sleep(0.01)
