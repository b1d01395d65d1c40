"""The head's node registry over real TCP connections (no stage processes: seconds, not minutes).

The test plays the node's side of the protocol (common/messages.py, link.py) with the same `connect` and
`Link` the real node uses, against a real StageHead + RemoteStageClient on this test's event loop.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from vllm_omni_plugin.common.limits import RequestLimits
from vllm_omni_plugin.common.link_messages import (
    Heartbeat,
    Ping,
    Register,
    Rejected,
    StageStatus,
    Superseded,
    ToStage,
    Welcome,
)
from vllm_omni_plugin.common.messages import (
    Abort,
    ConnectorCounters,
    DiffusionSettings,
    GenerationParams,
    Progress,
    Pulse,
    Result,
    StageInfo,
    Submit,
)
from vllm_omni_plugin.common.payload import Via
from vllm_omni_plugin.config import load_deploy_config
from vllm_omni_plugin.connectors.base import PayloadDescriptor
from vllm_omni_plugin.connectors.stats import all_snapshots
from vllm_omni_plugin.orchestrator import Orchestrator, StageUnavailableError, remote, remote_stage
from vllm_omni_plugin.orchestrator.connector_stats import absorb
from vllm_omni_plugin.orchestrator.link import AuthenticationError, Link, connect
from vllm_omni_plugin.orchestrator.node import stage_init
from vllm_omni_plugin.orchestrator.node_protocol import parse_stage_ids
from vllm_omni_plugin.serving.deferred_limits import limits_or_deferred
from vllm_omni_plugin.serving.errors import APIError
from vllm_omni_plugin.serving.handlers import ImageService

KEY = b"registry-test-key"
SETTINGS = DiffusionSettings({}, "cpu", "torch.float32", None, 1, 0.0, None, None, 1, None)


def dit_info(limits: RequestLimits | None = None) -> StageInfo:
    return StageInfo("diffusion", SETTINGS, limits=limits)


DIT = {1: StageStatus("diffusion", True, dit_info(), pid=4242)}


@pytest.fixture
async def head():
    cfg = load_deploy_config("glm_image_tiny_nixl", model="/unused/glm-image")
    h = remote.StageHead(KEY, 0, "127.0.0.1")
    h.local_ids = [0]
    client = h.client_for(stage_init(cfg, 1))
    await h.start()
    yield h, client
    h.close()


async def recv(link: Link, timeout: float = 5.0):
    return await asyncio.get_running_loop().run_in_executor(None, link.recv, timeout)


async def register(port: int, stages=DIT, key: bytes = KEY, node: str = "n1"):
    loop = asyncio.get_running_loop()
    sock = await loop.run_in_executor(None, connect, "127.0.0.1", port, key, 5.0)
    conn = Link(sock, "head")
    conn.send(Register(node, "host", 1, stages))
    return conn, await recv(conn)


async def until(predicate, timeout: float = 5.0) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


DESC = PayloadDescriptor(
    "shm", "shm", "r:0->1:abc", "r", 0, 1, "tensor", "int64", (1, 16), 128, 30.0, "/dev/shm/p"
)


def submit(rid: str) -> Submit:
    params = GenerationParams("x", seed=7)
    return Submit(rid, params, inputs={0: Via("shm", DESC)}, to_stage=None)


async def test_wrong_key_is_refused(head):
    h, client = head
    with pytest.raises(AuthenticationError):
        await register(h.port, key=b"another key")
    assert not client.ready
    with pytest.raises(StageUnavailableError, match="no live node"):
        await client.submit(submit("r0"))


async def test_a_stage_the_head_runs_itself_is_rejected(head):
    h, client = head
    conn, reply = await register(h.port, stages={0: StageStatus("ar", True)})
    assert isinstance(reply, Rejected) and "not a remote stage" in reply.reason
    conn, reply = await register(h.port, stages={1: StageStatus("ar", True)})
    assert isinstance(reply, Rejected) and "diffusion" in reply.reason
    assert not client.ready


async def test_submit_abort_result_and_status_round_trip(head):
    h, client = head
    conn, reply = await register(h.port)
    assert isinstance(reply, Welcome)
    await until(lambda: client.ready)
    assert client.describe() == dit_info() and client.pid == 4242

    task = asyncio.ensure_future(client.submit(submit("r1")))
    routed = await recv(conn)
    assert isinstance(routed, ToStage) and routed.stage_id == 1
    assert isinstance(routed.msg, Submit) and routed.msg.request_id == "r1"
    assert routed.msg.params == GenerationParams("x", seed=7)
    via = routed.msg.inputs[0]  # the descriptor, decoded typed on the node
    assert isinstance(via, Via) and via.connector == "shm" and via.desc == DESC
    conn.send(Result("r1", output=[b"png"], stage_s=0.25))
    result = await asyncio.wait_for(task, 5)
    stats = client.stats()
    assert result.output == [b"png"] and stats.completed == 1 and stats.busy_s == 0.25

    task = asyncio.ensure_future(client.submit(submit("r2")))  # cancelled: abort reaches node
    assert (await recv(conn)).msg.request_id == "r2"
    task.cancel()
    aborted = await recv(conn)
    assert isinstance(aborted.msg, Abort) and aborted.msg.request_id == "r2"

    conn.send(Heartbeat({1: StageStatus("diffusion", False, dit_info())}))
    assert isinstance(await recv(conn), Ping)  # the head answers heartbeats
    await until(lambda: not client.ready)  # the node's stage is restarting: 503s
    with pytest.raises(StageUnavailableError):
        await client.submit(submit("r3"))
    conn.send(Heartbeat(DIT))
    await until(lambda: client.ready)


async def test_node_lost_fails_in_flight_at_once_and_reregistration_resumes(head):
    h, client = head
    conn, _ = await register(h.port)
    await until(lambda: client.ready)
    task = asyncio.ensure_future(client.submit(submit("r1")))
    await recv(conn)
    conn.close()  # the node dies: EOF on the head's side
    t0 = time.monotonic()
    with pytest.raises(StageUnavailableError, match="lost"):
        await asyncio.wait_for(task, 5)
    assert time.monotonic() - t0 < 1.0
    assert not client.ready and client.deaths == 1

    conn, reply = await register(h.port, node="n2")
    assert isinstance(reply, Welcome)
    await until(lambda: client.ready)
    assert client.restarts == 1


async def test_newer_registration_supersedes_an_old_node_that_does_not_answer(head):
    """The old node sends nothing after registering (hung, or its link half-dead): a node that
    proves the key takes its stage after TAKEOVER_PROBE_S, not before."""
    h, client = head
    old, _ = await register(h.port, node="old")
    await until(lambda: client.ready)
    task = asyncio.ensure_future(client.submit(submit("r1")))
    await recv(old)
    t0 = time.monotonic()
    new, reply = await register(h.port, node="new")
    assert isinstance(reply, Welcome)
    assert remote.TAKEOVER_PROBE_S - 0.2 <= time.monotonic() - t0 < remote.TAKEOVER_PROBE_S + 2
    assert isinstance(await recv(old), Superseded)  # the old node is told to exit
    with pytest.raises(StageUnavailableError):
        await asyncio.wait_for(task, 5)
    await until(lambda: client.ready and client.link.peer.startswith("new"))


async def test_missed_heartbeats_drop_a_hung_node(head, monkeypatch):
    monkeypatch.setattr(remote, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(remote, "DEAD_AFTER_S", 1.0)
    h, client = head
    h._watchdog.cancel()
    h._watchdog = asyncio.ensure_future(h._watch())  # with the shortened period
    conn, _ = await register(h.port)  # registers, then never says anything again
    await until(lambda: client.ready)
    task = asyncio.ensure_future(client.submit(submit("r1")))
    with pytest.raises(StageUnavailableError, match="no heartbeat"):
        await asyncio.wait_for(task, 5)
    assert not client.ready


async def test_a_heartbeating_node_whose_stage_stops_producing_is_dropped(head, monkeypatch):
    # The head's backstop behind the node's own stall watchdog: progress is the stage's relayed
    # Progress/Pulse messages, never the node's heartbeats.
    monkeypatch.setattr(remote, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(remote_stage, "STALL_GRACE_S", 0.2)
    h, client = head
    client.pending.stall_timeout_s = 1.0
    h._watchdog.cancel()
    h._watchdog = asyncio.ensure_future(h._watch())  # with the shortened period
    conn, _ = await register(h.port)
    await until(lambda: client.ready)

    async def heartbeats() -> None:
        while True:
            conn.send(Heartbeat(DIT))
            await asyncio.sleep(0.1)

    async def routed() -> ToStage:
        while not isinstance(msg := await recv(conn), ToStage):  # skip the head's Pings
            pass
        return msg

    beating = asyncio.ensure_future(heartbeats())
    try:
        # Pulses and streaming steps for twice the deadline: not a stall; the steps reach the
        # request's listener in order.
        seen = []
        task = asyncio.ensure_future(client.submit(submit("r1"), on_progress=seen.append))
        await routed()
        for step in range(1, 21):
            conn.send(Pulse(1))
            conn.send(Progress("r1", 1, "diffusion", step, 20))
            await asyncio.sleep(0.1)
        assert not task.done() and client.ready
        conn.send(Result("r1", output=[b"png"]))
        assert (await asyncio.wait_for(task, 5)).output == [b"png"]
        assert [(p.stage, p.step, p.total_steps) for p in seen] == [
            ("diffusion", i, 20) for i in range(1, 21)
        ]

        # Heartbeats go on, the stage says nothing: 503 after the deadline and the grace.
        task = asyncio.ensure_future(client.submit(submit("r2")))
        await routed()
        t0 = time.monotonic()
        with pytest.raises(StageUnavailableError, match="made no progress"):
            await asyncio.wait_for(task, 5)
        waited = time.monotonic() - t0
        assert 1.0 <= waited < 1.0 + 0.2 + 0.5, waited  # + the head's check period and slack
        assert client.stalls == 1 and not client.ready
    finally:
        beating.cancel()


async def test_head_answers_503_until_nodes_register_then_validates_with_their_limits():
    cfg = load_deploy_config("glm_image_tiny_nixl", model="/unused/glm-image")
    h = remote.StageHead(KEY, 0, "127.0.0.1")  # no local stage: nothing to spawn here
    orchestrator = Orchestrator(cfg, stage_factory=h.stage_factory(10.0))
    await h.start()
    await orchestrator.start()
    service = ImageService(orchestrator, limits_or_deferred(orchestrator, cfg.serving), ["m"])

    async def never() -> None:
        await asyncio.Event().wait()

    async def status(body: bytes) -> int:
        with pytest.raises(APIError) as err:
            await service.generate(body, "http://head/", never)
        return err.value.status

    try:
        assert not orchestrator.healthy() and orchestrator.unhealthy_stages() == [0, 1]
        assert await status(b'{"prompt": "a cat"}') == 503  # no limits known yet: stage missing
        limits = RequestLimits(
            granularity=32,
            min_height=64,
            min_width=64,
            max_height=1024,
            max_width=1024,
            max_steps=200,
            max_batch_size=4,
            default_height=64,
            default_width=64,
        )
        info = dit_info(limits)  # typed over the link
        conn, _ = await register(h.port, stages={1: StageStatus("diffusion", True, info)})
        await until(lambda: orchestrator.stages[1].ready)
        # The final stage's limits now apply on the head; stage 0 still has no node: 503.
        assert await status(b'{"prompt": "a cat", "size": "65x64"}') == 400
        assert await status(b'{"prompt": "a cat", "num_inference_steps": 201}') == 400
        assert await status(b'{"prompt": "a cat"}') == 503
        conn.close()
    finally:
        orchestrator.shutdown()
        h.close()


def test_connector_counters_ride_results_into_the_exporter():
    snap = {
        "name": "registry-test",
        "puts": 0,
        "put_bytes": 0,
        "timeouts": 0,
        "expired": 0,
        "roles": {
            role: {
                "transfers": 2,
                "bytes": 64,
                "failures": 0,
                "latency_buckets": [0] * 15,
                "latency_sum": 0.0,
            }
            for role in ("producer", "consumer")
        },
    }
    counters = msgspec.convert({"source": "n:1", "snapshots": [snap]}, ConnectorCounters)
    result = Result("r", metrics={"k": 1}, connector_stats=counters)
    absorb(result)
    assert result.metrics == {"k": 1} and result.connector_stats is None  # taken off
    merged = {s["name"]: s for s in all_snapshots()}["registry-test"]
    assert merged["roles"]["consumer"]["transfers"] == 2


def test_stage_ids_are_checked_against_the_pipeline():
    cfg = load_deploy_config("glm_image_tiny_nixl", model="/unused/glm-image")
    assert parse_stage_ids("1", cfg) == [1]
    assert parse_stage_ids("1,0", cfg) == [0, 1]
    for bad in ("2", "x", ","):
        with pytest.raises(SystemExit):
            parse_stage_ids(bad, cfg)


async def test_a_registration_never_replaces_a_live_node(head):
    """The newest registration does not simply win. A node that keeps heartbeating
    keeps its stage; another node holding the key is refused (Rejected, saying why), and the
    live node's link, requests and readiness are untouched."""
    h, client = head
    live, _ = await register(h.port, node="live")
    await until(lambda: client.ready)
    stop = asyncio.Event()

    async def heartbeat() -> None:
        while not stop.is_set():
            live.send(Heartbeat(DIT))
            await asyncio.sleep(0.3)

    beating = asyncio.ensure_future(heartbeat())
    try:
        task = asyncio.ensure_future(client.submit(submit("r1")))
        while isinstance(msg := await recv(live), Ping):  # the head's answers to heartbeats
            pass
        assert isinstance(msg, ToStage)
        intruder, reply = await register(h.port, node="intruder")
        assert isinstance(reply, Rejected) and "still answer" in reply.reason, reply
        assert client.ready and client.link.peer.startswith("live") and client.deaths == 0
        assert not task.done()  # the in-flight request still waits on the live node
        intruder.close()
    finally:
        stop.set()
        await beating
    task.cancel()
    live.close()
