"""A headless stage node: `vllm serve MODEL --stage-config FILE --headless --stage-ids 1
--omni-master-address HEAD --omni-master-port P`.

It runs only its stages, with the very code the head uses for local stages (StageClient ->
StageProcess -> `python -m vllm_omni_plugin.stages.worker`, titled `omni-stage-<id>`, restarted
when it dies), then registers with the head and relays: Submit/Abort in, Result out. Stage
payloads never pass through here: the descriptor in a Submit is resolved by the stage process
itself (NIXL READ from the producer). The stages' Progress and Pulse messages are relayed to
the head as they arrive (the same Progress and Pulse messages): streaming works across nodes, and the
head's stall watchdog sees a stage that stops producing while this node still heartbeats.
Streamed edges: each stage here also listens on TCP, on the address this node reaches the head
from (its status tells the head, which hands it to producers on other nodes; a producer on this
node gets the stage's local address instead). A Submit's edge tokens arrive masked under the
link's key and are unmasked here (edge_tokens.py); a final stage's Chunks go to the head over
the link and its Credits come back, and its StreamWaits are relayed like its Pulses.
The node's own StageClient runs the same watchdog and restarts such a stage here. The node
heartbeats; if the head goes silent or away it aborts its in-flight work and registers again
once the head is back. No HTTP server runs here.
The node ends with the process that started it (a shell, a launcher, `sudo`): when that dies,
the node stops its stages and exits instead of waiting for a head for good
(common/parent_watch.py). Started by init or a container runtime (parent pid 1) there is
nothing to watch; OMNI_NODE_OUTLIVES_PARENT=1 keeps a node that should outlive its launcher
(`nohup ... &` from a login shell) running.
A head address other than loopback needs VLLM_OMNI_AUTHKEY (node_protocol.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from typing import Any

import msgspec

from ..common.link_messages import (
    Heartbeat,
    Ping,
    Register,
    Rejected,
    StageStatus,
    Superseded,
    ToStage,
    Unavailable,
    Welcome,
)
from ..common.messages import Abort, Chunk, Credit, Progress, Pulse, Result, StreamWait, Submit
from ..common.parent_watch import end_process_tree, watch_parent
from ..config.stage_init import StageInit
from ..connectors.edge_channel import EDGE_TCP_HOST_ENV
from .edge_tokens import unmask_tokens
from .errors import StageUnavailableError
from .link import AuthenticationError, Link, connect
from .node_protocol import (
    DEAD_AFTER_S,
    HEARTBEAT_S,
    REGISTER_TIMEOUT_S,
    authkey,
    parse_stage_ids,
)
from .stage_client import StageClient

logger = logging.getLogger("vllm_omni_plugin.orchestrator.node")

RETRY_MAX_S = 5.0
OUTLIVE_PARENT_ENV = "OMNI_NODE_OUTLIVES_PARENT"
# After the node's parent died: how long the node may take to stop its stages cleanly (each
# gets stage_process.STOP_WAIT_S) before it kills them and itself.
PARENT_GONE_GRACE_S = 9.0


def local_address_towards(host: str, port: int) -> str:
    """This host's address on the route to `host` (no packet is sent: a UDP socket's connect
    only picks the route)."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(addr)
        return probe.getsockname()[0]


def listening_on(init: StageInit, host: str) -> StageInit:
    """The stage's StageInit with its TCP listener for streamed edges on `host`."""
    runtime = init.stage.runtime
    runtime = runtime.model_copy(update={"env": {**runtime.env, EDGE_TCP_HOST_ENV: host}})
    return dataclasses.replace(init, stage=init.stage.model_copy(update={"runtime": runtime}))


def node_stage_inits(cfg: Any, stage_ids: list[int], head: tuple[str, int]) -> dict[int, StageInit]:
    """This node's stages; those that read a streamed edge listen on TCP as well, on the
    address this node reaches the head from (SystemExit when the head's name does not
    resolve: nobody could reach them)."""
    topo = cfg.topology
    inits = {sid: stage_init(cfg, sid) for sid in stage_ids}
    consumers = [
        sid for sid in stage_ids if any(topo.streams(src, sid) for src in topo.stage(sid).inputs)
    ]
    if consumers:
        try:
            host = local_address_towards(*head)
        except OSError as exc:
            raise SystemExit(
                f"--omni-master-address {head[0]!r}: cannot find this node's address towards "
                f"it ({exc}); stage(s) {consumers} need one for their streamed edges"
            ) from None
        for sid in consumers:
            inits[sid] = listening_on(inits[sid], host)
    return inits


def stage_init(cfg: Any, stage_id: int) -> StageInit:
    """The StageInit the head's orchestrator would build for this stage (typed config)."""
    spec = next(s for s in cfg.topology.stages if s.stage_id == stage_id)
    return StageInit(
        stage=cfg.stage(stage_id),
        spec=spec,
        pipeline=cfg.pipeline,
        connectors=dict(getattr(cfg, "connectors", None) or {}),
    )


class HeadlessNode:
    def __init__(
        self,
        cfg: Any,
        stage_ids: list[int],
        head: tuple[str, int],
        key: bytes,
        *,
        startup_timeout_s: float,
        parent_pid: int | None = None,
    ):
        self.head = head
        self.parent_pid = parent_pid  # None: the node does not end with its parent
        self._loop: asyncio.AbstractEventLoop | None = None
        self.key = key
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.stages = {
            sid: StageClient(init, startup_timeout_s=startup_timeout_s)
            for sid, init in node_stage_inits(cfg, stage_ids, head).items()
        }
        self.tasks: dict[str, asyncio.Task] = {}
        self.link: Link | None = None
        self.superseded = False
        for stage in self.stages.values():
            stage.on_pulse = self._relay_pulse
            stage.on_wait = self._relay_pulse

    def statuses(self) -> dict[int, StageStatus]:
        return {
            sid: StageStatus(
                s.kind,
                s.ready,
                s.describe(),
                s.restarts,
                s.deaths,
                s.pid,
                s.edge_tcp_address or "",
            )
            for sid, s in self.stages.items()
        }

    # ---- main loop ---------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        if self.parent_pid is not None:
            watch_parent(self._parent_gone, self.parent_pid)
        try:
            # A stop (signal, parent gone) during start-up stops at once: the starts are
            # cancelled, and `finally` kills whatever they started.
            starting = asyncio.gather(
                *(s.start() for s in self.stages.values()), return_exceptions=True
            )
            stop = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait({starting, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not starting.done():
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
                return 0
            errors = [r for r in starting.result() if isinstance(r, BaseException)]
            if errors:
                logger.error("headless node: a stage failed to start: %s", errors[0])
                return 1
            logger.info("headless node %s: stage(s) %s ready", self.name, sorted(self.stages))
            while not self._stop.is_set() and not self.superseded:
                link = await self._connect()
                if link is not None:
                    await self._serve(link)
            return 0
        finally:
            # In a thread: the loop must keep running meanwhile, it writes each stage its
            # Shutdown (a blocked loop left every stage to be killed after its stop wait).
            await asyncio.to_thread(shutdown_concurrently, list(self.stages.values()))

    def _parent_gone(self, parent: int) -> None:
        # The watch thread: stop as on SIGTERM, and make sure it does not take longer.
        logger.warning(
            "the process that started this node (pid %d) is gone; stopping its stages", parent
        )
        assert self._loop is not None  # set before the watch starts
        self._loop.call_soon_threadsafe(self._stop.set)
        time.sleep(PARENT_GONE_GRACE_S)  # a clean exit ends the process (and this thread) first
        logger.error("the node did not stop within %.0f s; killing it", PARENT_GONE_GRACE_S)
        end_process_tree()

    async def _connect(self) -> Link | None:
        """Connect and register, retrying with backoff until the head answers or we stop."""
        loop = asyncio.get_running_loop()
        host, port = self.head
        delay, attempt = 0.5, 0
        while not self._stop.is_set():
            attempt += 1
            link = None
            try:
                session = await loop.run_in_executor(None, connect, host, port, self.key, 10.0)
                link = Link(session, f"head {host}:{port}")
                link.send(Register(self.name, socket.gethostname(), os.getpid(), self.statuses()))
                reply = await loop.run_in_executor(None, link.recv, REGISTER_TIMEOUT_S)
                if isinstance(reply, Welcome):
                    logger.info("registered stage(s) %s with %s", sorted(self.stages), link.peer)
                    return link
                why = reply.reason if isinstance(reply, Rejected) else repr(reply)
                logger.error("head %s:%d rejected this node: %s", host, port, why)
                link.close()
                delay = RETRY_MAX_S
            except Exception as exc:  # head not up yet, wrong key, network down
                if link is not None:
                    link.close()
                if isinstance(exc, AuthenticationError):
                    logger.error("cannot register with head %s:%d: %s", host, port, exc)
                    delay = RETRY_MAX_S  # a key mismatch does not fix itself in 0.5 s
                elif attempt == 1 or attempt % 10 == 0:
                    logger.warning("cannot register with head %s:%d: %r; retrying", host, port, exc)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)
            delay = min(delay * 2, RETRY_MAX_S)
        return None

    async def _serve(self, link: Link) -> None:
        loop = asyncio.get_running_loop()
        lost: asyncio.Future[str] = loop.create_future()

        def on_lost(_link: Link, why: str) -> None:
            if not lost.done():
                lost.set_result(why)

        self.link = link
        link.start_reader(loop, self._on_message, on_lost)
        beat = asyncio.ensure_future(self._heartbeat(link))
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({lost, stop}, return_when=asyncio.FIRST_COMPLETED)
        beat.cancel()
        stop.cancel()
        link.close()
        self.link = None
        why = lost.result() if lost.done() else "node shutting down"
        # The head failed (or will fail) these requests already; drop their work.
        for task in list(self.tasks.values()):
            task.cancel()
        if not self._stop.is_set() and not self.superseded:
            logger.warning("lost the head (%s); registering again", why)

    async def _heartbeat(self, link: Link) -> None:
        while link.alive:
            try:
                link.send(Heartbeat(self.statuses()))
            except OSError:
                link.drop("send failed")
                return
            except (TypeError, ValueError) as exc:  # never a silent end of the heartbeats
                logger.exception("cannot encode this node's heartbeat")
                link.drop(f"heartbeat not encodable ({exc})")
                return
            await asyncio.sleep(HEARTBEAT_S)
            silent = time.monotonic() - link.last_seen
            if silent > DEAD_AFTER_S:
                link.drop(f"head silent for {silent:.1f} s")
                return

    def _relay_pulse(self, msg: Pulse | StreamWait) -> None:
        link = self.link
        if link is not None:
            with contextlib.suppress(OSError):  # a lost head is noticed by the reader
                link.send(msg)

    # ---- messages from the head --------------------------------------------------------
    def _on_message(self, link: Link, msg: Any) -> None:
        if isinstance(msg, ToStage) and isinstance(msg.msg, Submit):
            rid = msg.msg.request_id
            try:
                submit = self._local_submit(msg)
            except ValueError as exc:
                link.drop(f"a Submit for {rid} this node cannot read: {exc}")
                return
            self.tasks[rid] = asyncio.ensure_future(self._run(link, msg.stage_id, submit))
        elif isinstance(msg, ToStage) and isinstance(msg.msg, Abort):
            task = self.tasks.pop(msg.msg.request_id, None)
            if task is not None:
                task.cancel()  # StageClient.submit aborts the request in the stage
        elif isinstance(msg, ToStage) and isinstance(msg.msg, Credit):
            stage = self.stages.get(msg.stage_id)
            if stage is not None:
                stage.send_stream(msg.msg)
        elif isinstance(msg, ToStage) and isinstance(msg.msg, StreamWait):
            stage = self.stages.get(msg.stage_id)
            if stage is not None:
                stage.set_waiting(msg.msg.request_id, msg.msg.waiting)
        elif isinstance(msg, Superseded):
            logger.error("superseded: %s; exiting", msg.reason)
            self.superseded = True
            link.drop("superseded")
        elif not isinstance(msg, (Ping, Welcome, Rejected)):  # Ping: only feeds last_seen
            link.drop(f"unexpected {type(msg).__name__} from the head")

    def _local_submit(self, msg: ToStage) -> Submit:
        """The Submit as the stage takes it: its edge tokens unmasked, and an edge to a stage
        of this node through that stage's local address instead of its TCP one."""
        submit = msg.msg
        assert isinstance(submit, Submit)
        if msg.token_nonce:
            submit = unmask_tokens(submit, self.key, msg.token_nonce)
        consumer = self.stages.get(submit.to_stage) if submit.to_stage is not None else None
        if submit.stream_to is not None and consumer is not None and consumer.edge_address:
            # Its current process's, whatever the head last heard (it may have restarted).
            submit = msgspec.structs.replace(submit, stream_to=consumer.edge_address)
        return submit

    async def _run(self, link: Link, stage_id: int, msg: Submit) -> None:
        rid = msg.request_id
        stage = self.stages.get(stage_id)
        reply: Result | Unavailable
        try:
            if stage is None:
                raise StageUnavailableError(f"node {self.name} does not run stage {stage_id}")

            def relay(progress: Progress | Chunk) -> None:
                with contextlib.suppress(OSError):
                    link.send(progress)

            on_stream = relay if msg.stream_output and msg.stream_to is None else None
            reply = await stage.submit(msg, on_progress=relay, on_stream=on_stream)
        except StageUnavailableError as exc:
            reply = Unavailable(rid, str(exc))
        except asyncio.CancelledError:
            return
        finally:
            self.tasks.pop(rid, None)
        with contextlib.suppress(OSError):
            link.send(reply)


def shutdown_concurrently(stages: list[StageClient]) -> None:
    """Stop every stage at once: each StageClient.shutdown may wait seconds for its process,
    and a node going down (SIGTERM) should take the longest one's time, not the sum."""
    threads = [threading.Thread(target=s.shutdown, name=f"omni-stop-{s.stage_id}") for s in stages]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_node(args: argparse.Namespace) -> None:
    """`vllm serve ... --stage-config FILE --headless`: run this node until SIGTERM."""
    from ..config.serve_args import load_config
    from .orchestrator import DEFAULT_STARTUP_TIMEOUT_S, STARTUP_TIMEOUT_ENV

    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    # Read first: the node ends with this process, even one that dies while the node loads.
    parent = None if os.environ.get(OUTLIVE_PARENT_ENV) == "1" else os.getppid()
    cfg = load_config(args)
    if getattr(args, "stage_ids", None) is None:
        raise SystemExit("--headless with --stage-config needs --stage-ids (the stages to run)")
    if not getattr(args, "omni_master_address", None) or not getattr(args, "omni_master_port", 0):
        raise SystemExit(
            "--headless with --stage-config needs --omni-master-address and --omni-master-port "
            "(the head's node registry)"
        )
    ids = parse_stage_ids(args.stage_ids, cfg)
    with contextlib.suppress(ImportError):
        from setproctitle import setproctitle

        setproctitle(f"omni-node stages={','.join(map(str, ids))} ({cfg.pipeline})")
    # Before any stage starts: a remote head without VLLM_OMNI_AUTHKEY is refused at once.
    key = authkey(cfg, args.omni_master_address, "node")
    timeout = float(os.environ.get(STARTUP_TIMEOUT_ENV, DEFAULT_STARTUP_TIMEOUT_S))
    node = HeadlessNode(
        cfg,
        ids,
        (args.omni_master_address, int(args.omni_master_port)),
        key,
        startup_timeout_s=timeout,
        parent_pid=parent,
    )
    code = asyncio.run(node.run())
    if code:
        raise SystemExit(code)
