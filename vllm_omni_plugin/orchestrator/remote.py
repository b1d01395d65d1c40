"""Head side of a multi-node deployment: the node registry (StageHead).

`vllm serve MODEL --stage-config FILE --stage-ids 0 --omni-master-port P` runs stage 0 locally
(a StageClient) and every other stage as a RemoteStageClient: the same face to the orchestrator
(submit/abort/ready/info and the counters /metrics reads), backed by whichever headless node
registered that stage. Without a live node the stage is not ready: /health is unhealthy and
requests fail fast with StageUnavailableError (HTTP 503). A node that closes its connection or
misses heartbeats fails its in-flight requests at once; when a node (re)registers, serving
resumes. A registration never takes a stage from a node that still answers: only from one that
is gone, or silent for TAKEOVER_PROBE_S while the newcomer (which proved the key) waits. The
wire protocol is described in node_protocol.py, the connection in link.py.

The registry listens on loopback unless --omni-master-address says otherwise, and refuses to
listen on any other address without VLLM_OMNI_AUTHKEY (node_protocol.require_explicit_key).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ..common.link_messages import (
    Heartbeat,
    Ping,
    Register,
    Rejected,
    Superseded,
    Unavailable,
    Welcome,
)
from ..common.messages import Chunk, Progress, Pulse, Result, StreamWait
from ..config.stage_init import StageInit
from .link import Link, accept
from .node_protocol import (
    DEAD_AFTER_S,
    DEFAULT_BIND,
    HANDSHAKE_DEADLINE_S,
    HEARTBEAT_S,
    TAKEOVER_PROBE_S,
    explicit_authkey,
    is_loopback,
    require_explicit_key,
)
from .remote_stage import RemoteStageClient
from .stage_client import StageClient

logger = logging.getLogger("vllm_omni_plugin.orchestrator.remote")

# Connections still authenticating, each on a thread for up to HANDSHAKE_DEADLINE_S: beyond
# this many, a new one is closed at once (a flood of strangers cannot pile up threads)...
MAX_PENDING_HANDSHAKES = 32
# ...and beyond this many from one address: one host cannot hold every slot, so a restarted
# node on another host still gets in while someone trickles bytes at the registry.
MAX_HANDSHAKES_PER_ADDRESS = 4


class StageHead:
    """Listens for headless nodes, authenticates and registers them, watches their heartbeats."""

    def __init__(self, authkey: bytes, port: int, bind: str = DEFAULT_BIND):
        self.authkey = authkey
        self.port = port
        self.bind = bind
        self.local_ids: list[int] = []
        self.clients: dict[int, RemoteStageClient] = {}
        self.links: set[Link] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: socket.socket | None = None
        self._watchdog: asyncio.Task | None = None
        self._closed = False
        self._handshakes = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._per_address: dict[str, int] = {}  # handshakes in progress by peer address
        self._per_address_lock = threading.Lock()
        self._pending: set[Link] = set()  # registrations waiting to see if a holder answers
        self._probes: set[asyncio.Task] = set()

    def client_for(self, init: StageInit) -> RemoteStageClient:
        client = RemoteStageClient(init, self)
        self.clients[client.stage_id] = client
        return client

    def stage_factory(self, startup_timeout_s: float) -> Callable[[StageInit], Any]:
        """For Orchestrator(stage_factory=...): local stages as usual, the others remote."""

        def make(init: StageInit) -> Any:
            if init.stage.stage_id in self.local_ids:
                return StageClient(init, startup_timeout_s=startup_timeout_s)
            return self.client_for(init)

        return make

    def call_in_loop(self, fn, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            fn(*args)
        elif _running_in(loop):
            fn(*args)
        else:
            loop.call_soon_threadsafe(fn, *args)

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        # Checked here as well as at key resolution: nothing listens beyond loopback unkeyed.
        require_explicit_key(self.bind, "head")
        self._loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in self.bind else socket.AF_INET  # "::", "::1"
        sock = socket.create_server((self.bind, self.port), family=family, reuse_port=False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        if not explicit_authkey():
            logger.info(
                "node registry: no VLLM_OMNI_AUTHKEY set; loopback only, with this user's "
                "random same-host key (a 0600 file, orchestrator/node_key.py)"
            )
        if is_loopback(self.bind):
            logger.info(
                "node registry on loopback: only nodes on this host can register (give the "
                "head --omni-master-address and VLLM_OMNI_AUTHKEY for nodes on other hosts)"
            )
        threading.Thread(target=self._accept_loop, name="omni-head-accept", daemon=True).start()
        self._watchdog = asyncio.ensure_future(self._watch())
        logger.info(
            "node registry listening on %s:%d for stage(s) %s",
            self.bind,
            self.port,
            sorted(self.clients),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        if self._watchdog is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._watchdog.cancel)
        for link in list(self.links) + list(self._pending):
            link.close()
        for task in list(self._probes):
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(task.cancel)

    # ---- threads: accept + handshake ---------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._closed:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return  # closed
            host = addr[0]
            with self._per_address_lock:
                mine = self._per_address.get(host, 0)
                if mine < MAX_HANDSHAKES_PER_ADDRESS:
                    self._per_address[host] = mine + 1
            if mine >= MAX_HANDSHAKES_PER_ADDRESS:
                logger.warning(
                    "node registry: %s already has %d connections authenticating; closing one",
                    host,
                    mine,
                )
                sock.close()
                continue
            if not self._handshakes.acquire(blocking=False):
                logger.warning("node registry: too many connections authenticating; closing one")
                self._release_address(host)
                sock.close()
                continue
            threading.Thread(
                target=self._handshake, args=(sock, addr), name="omni-head-handshake", daemon=True
            ).start()

    def _release_address(self, host: str) -> None:
        with self._per_address_lock:
            left = self._per_address.pop(host, 1) - 1
            if left > 0:
                self._per_address[host] = left

    def _handshake(self, sock: socket.socket, addr: Any) -> None:
        try:
            self._authenticate(sock, addr)
        finally:
            self._handshakes.release()
            self._release_address(addr[0])

    def _authenticate(self, sock: socket.socket, addr: Any) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        # One deadline for the whole exchange, Register included.
        deadline = time.monotonic() + HANDSHAKE_DEADLINE_S
        try:
            session = accept(sock, self.authkey, HANDSHAKE_DEADLINE_S)
        except Exception as exc:  # wrong key, garbage, timeout: drop it
            logger.warning("node registry: rejected connection from %s: %r", peer, exc)
            sock.close()
            return
        link = Link(session, peer)
        try:
            msg = link.recv(max(0.0, deadline - time.monotonic()))
        except Exception as exc:
            logger.warning("node registry: %s did not register: %r", peer, exc)
            link.close()
            return
        if not isinstance(msg, Register):
            logger.warning("node registry: %s sent %s, not Register", peer, type(msg).__name__)
            link.close()
            return
        link.peer = f"{msg.node}@{addr[0]}"
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._on_register, link, msg)

    # ---- loop: registry ----------------------------------------------------------------
    def _on_register(self, link: Link, msg: Register) -> None:
        problem = self._check(msg)
        if problem is not None:
            self._reject(link, problem)
            return
        # A live node's stage is never taken by a registration alone (anyone on a host that
        # holds the key could otherwise steal it): only when its node is gone (EOF, or missed
        # heartbeats) or does not answer while the newcomer, which proved the key, waits.
        now = time.monotonic()
        live = [old for old in self._holders(link, msg) if now - old.last_seen <= DEAD_AFTER_S]
        if not live:
            self._admit(link, msg)
            return
        logger.warning(
            "node registry: node %s registers stage(s) %s held by %s; it takes them over only "
            "if that node does not answer within %.1f s",
            link.peer,
            sorted(msg.stages),
            ", ".join(sorted(old.peer for old in live)),
            TAKEOVER_PROBE_S,
        )
        self._pending.add(link)
        task = asyncio.ensure_future(self._takeover_after_probe(link, msg, now))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    def _holders(self, link: Link, msg: Register) -> set[Link]:
        """The other live links holding any stage `msg` registers."""
        holders = (self.clients[sid].link for sid in msg.stages)
        return {old for old in holders if old is not None and old is not link and old.alive}

    async def _takeover_after_probe(self, link: Link, msg: Register, since: float) -> None:
        """A node heartbeats every HEARTBEAT_S: one that sent nothing since `since` for
        TAKEOVER_PROBE_S does not answer, and the newcomer takes its stages."""
        try:
            await asyncio.sleep(TAKEOVER_PROBE_S)
        finally:
            self._pending.discard(link)
        problem = self._check(msg)
        if problem is None:
            answering = sorted(
                old.peer for old in self._holders(link, msg) if old.last_seen > since
            )
            if answering:
                problem = (
                    f"stage(s) {sorted(msg.stages)} are served by live node(s) "
                    f"{', '.join(answering)}, which still answer; a stage moves to another node "
                    "only once its node is gone"
                )
        if problem is not None:
            self._reject(link, problem)
        else:
            self._admit(link, msg)

    def _reject(self, link: Link, problem: str) -> None:
        logger.error("node registry: rejected node %s: %s", link.peer, problem)
        with contextlib.suppress(OSError):
            link.send(Rejected(problem))
        link.close(flush=True)  # the node reads why before the connection ends

    def _admit(self, link: Link, msg: Register) -> None:
        # Holders still attached here are gone or silent: told to exit, replaced at once.
        for sid in msg.stages:
            old = self.clients[sid].link
            if old is not None and old is not link:
                with contextlib.suppress(OSError):
                    old.send(Superseded(f"node {link.peer} registered stage {sid}"))
                why = f"superseded by node {link.peer} (this node did not answer)"
                self.clients[sid].detach(old, why)  # now: the new link replaces it below
                old.drop(why, flush=True)
        try:
            link.send(Welcome(head=socket.gethostname()))
        except OSError:
            link.close()
            return
        self.links.add(link)
        for sid, status in msg.stages.items():
            self.clients[sid].attach(link, status)
        assert self._loop is not None
        link.start_reader(self._loop, self._on_message, self._on_lost)

    def _check(self, msg: Register) -> str | None:
        if self._closed:
            return "the head is shutting down"
        if not msg.stages:
            return "it runs no stage"
        for sid, status in msg.stages.items():
            client = self.clients.get(sid)
            if client is None:
                remote = sorted(self.clients)
                return f"stage {sid} is not a remote stage of this head (remote: {remote})"
            if status.kind != client.kind:
                return f"stage {sid} is {client.kind} here but {status.kind} on the node"
        return None

    def _on_message(self, link: Link, msg: Any) -> None:
        if isinstance(msg, Heartbeat):
            for sid, status in msg.stages.items():
                client = self.clients.get(sid)
                if client is not None and client.link is link:
                    client.update(status)
            with contextlib.suppress(OSError):
                link.send(Ping())
        elif isinstance(msg, Pulse):
            client = self.clients.get(msg.stage_id)
            if client is not None and client.link is link:
                client.on_pulse()
        elif isinstance(msg, Progress):
            client = self.clients.get(msg.stage_id)
            if client is not None and client.link is link:
                client.on_progress(msg)
        elif isinstance(msg, Chunk):
            client = self.clients.get(msg.from_stage)
            if client is not None and client.link is link:
                client.on_chunk(msg)
        elif isinstance(msg, StreamWait):
            client = self.clients.get(msg.stage_id)
            if client is not None and client.link is link:
                client.on_stream_wait(msg)
        elif isinstance(msg, (Result, Unavailable)):
            for client in self.clients.values():
                if client.link is link and client.owns(msg.request_id):
                    if isinstance(msg, Result):
                        client.on_result(msg)
                    else:
                        client.on_unavailable(msg)
                    break
        else:  # decodes, but a node has no business sending it (Welcome, ToStage, ...)
            link.drop(f"unexpected {type(msg).__name__} from a node")

    def _on_lost(self, link: Link, why: str) -> None:
        self.links.discard(link)
        for client in self.clients.values():
            client.detach(link, why)

    async def _watch(self) -> None:
        """Missed heartbeats: a hung node (SIGSTOP, dead network) is dropped like a dead one;
        so is one that heartbeats while a stage of it holding requests stopped producing."""
        while not self._closed:
            await asyncio.sleep(HEARTBEAT_S)
            now = time.monotonic()
            for link in list(self.links):
                if now - link.last_seen > DEAD_AFTER_S:
                    link.drop(f"no heartbeat for {now - link.last_seen:.1f} s")
            for client in self.clients.values():
                client.check_stall(now)


def _running_in(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def head_from_args(cfg: Any, args: Any) -> StageHead | None:
    """The node registry for `vllm serve ... --stage-ids 0 --omni-master-port P`, or None.

    `--stage-ids` lists the stages this head runs itself; every other stage of the pipeline is
    remote. `--omni-master-address` on the head is the address to listen on (default:
    loopback); any other address needs VLLM_OMNI_AUTHKEY (SystemExit naming it otherwise).
    """
    from .node_protocol import authkey, parse_stage_ids

    ids_arg = getattr(args, "stage_ids", None)
    port = getattr(args, "omni_master_port", None)
    if ids_arg is None and port is None:
        return None
    if ids_arg is None:
        raise SystemExit("--omni-master-port on the head needs --stage-ids (its local stages)")
    if port is None:
        raise SystemExit(
            f"--stage-ids {ids_arg} runs the other stages on headless nodes: give the head "
            "--omni-master-port for them to register on"
        )
    local = parse_stage_ids(ids_arg, cfg)
    refuse_streams_into_head(cfg, local)
    bind = getattr(args, "omni_master_address", None) or DEFAULT_BIND
    head = StageHead(authkey(cfg, bind, "head"), int(port), bind)
    head.local_ids = local
    return head


def refuse_streams_into_head(cfg: Any, local: list[int]) -> None:
    """SystemExit for a streamed edge from a stage on a node into a stage the head runs: the
    head's stages listen for streamed edges on this host only (a node's stages listen on TCP
    too), so such a producer could not reach its consumer."""
    topo = cfg.topology
    for src, dst in topo.edges:
        if topo.streams(src, dst) and src not in local and dst in local:
            raise SystemExit(
                f"--stage-ids {','.join(map(str, local))}: stage {src} (on a node) streams into "
                f"stage {dst} (on the head), which takes streamed edges from this host only; "
                f"run stage {dst} on a node too, or stage {src} on the head"
            )
