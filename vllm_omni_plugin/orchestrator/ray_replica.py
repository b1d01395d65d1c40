"""One stage replica as a Ray actor: it runs the stage's usual process and relays requests.

The actor is a thin supervisor around the same stage process a local deployment runs
(stage_process.py, through a StageClient that does not restart): the stage keeps its own
process group (a vLLM EngineCore dies with it) and its connectors (NIXL across nodes) as
today. The replica is the pair, and Ray restarts the pair as one unit:

* the actor's process dies (SIGKILL, OOM): Ray restarts the actor; the orphaned stage
  process reads EOF on its control socket and exits by itself;
* the stage process dies: the actor exits at once, so Ray restarts it.

After a restart the driver (ray_backend.py) calls `start` again, which spawns a new stage
process and returns when it is ready.

`submit` is a Ray streaming generator: the request's Progress messages, a chat stage's text
outputs and a final streaming stage's Chunks go to the driver as they come, then its Result.
A stage that reads a streamed edge also listens on TCP on its node's address (`start` returns
it): the producer's replica, on this node or another, opens the request's channel there.
Credits and the caller's waits (`send_stream`, `set_waiting`) come back as calls of their own;
the stage's watchdog runs here, in the replica's StageClient, per chunk as on a single host.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from ..common.messages import GenerateText, Progress, Submit
from ..config.stage_init import StageInit
from .errors import StageUnavailableError
from .handle import StageState
from .node import listening_on
from .stage_client import StageClient

logger = logging.getLogger("vllm_omni_plugin.orchestrator.ray")

WATCH_INTERVAL_S = 0.2
# Progress reports a request may have queued for the driver; more are dropped (a later one
# says as much).
PROGRESS_BACKLOG = 64
# Its other outputs (a chat stage's TextOutputs, a final stage's Chunks) queued for the driver
# at most: none may be dropped, so a request whose driver falls this far behind fails. The
# driver drains the queue as Ray delivers; a final stage has at most its window of chunks
# unconsumed anyway (the driver's Credits release more).
OUTPUT_BACKLOG = 4096


class StageReplicaActor:
    """Created with `ray.remote(StageReplicaActor).options(...)` by ray_backend.py."""

    def __init__(
        self, init: StageInit, replica: int, startup_timeout_s: float, edge_listener: bool
    ):
        self.init = init
        self.replica = replica
        self.startup_timeout_s = startup_timeout_s
        self.edge_listener = edge_listener  # it reads a streamed edge: listen on TCP too
        self.client: StageClient | None = None
        self._starting: asyncio.Lock | None = None
        self._requests: dict[str, asyncio.Task] = {}  # in flight: request id -> its submit

    async def start(self) -> dict[str, Any]:
        """Spawn the stage process (once per actor life) and describe the replica."""
        import ray

        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self.client is None:
                init = _on_ray_devices(self.init)
                if self.edge_listener:
                    init = listening_on(init, ray.util.get_node_ip_address())
                client = StageClient(
                    init,
                    startup_timeout_s=self.startup_timeout_s,
                    restart=False,
                )
                await client.start()  # StageStartupError reaches the driver as the cause
                self.client = client
                asyncio.ensure_future(self._exit_when_stage_dies(client))
        return {
            "info": self.client.describe(),
            "pid": os.getpid(),
            "stage_pid": self.client.pid,
            "node_ip": ray.util.get_node_ip_address(),
            "edge_address": self.client.edge_tcp_address,
        }

    async def submit(self, msg: Submit | GenerateText) -> AsyncIterator[Any]:
        """The request's Progress, TextOutputs and Chunks as they come, then its Result (a
        generator: the driver calls it with Ray's streaming returns)."""
        client = self.client
        if client is None:
            raise StageUnavailableError(f"replica {self.replica} has no stage process yet")
        queue: asyncio.Queue = asyncio.Queue(maxsize=PROGRESS_BACKLOG + OUTPUT_BACKLOG)
        overflow: list[str] = []

        def on_output(out: Any) -> None:
            if isinstance(out, Progress):
                if queue.qsize() < PROGRESS_BACKLOG:
                    queue.put_nowait(out)
                return
            try:
                queue.put_nowait(out)
            except asyncio.QueueFull:
                overflow.append(f"{OUTPUT_BACKLOG} outputs of the request wait for the driver")
                task.cancel()  # the StageClient sends the stage its Abort

        task = asyncio.ensure_future(client.submit(msg, on_progress=on_output, on_stream=on_output))
        self._requests[msg.request_id] = task
        getter: asyncio.Future | None = None
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()  # the request ended; an item it left stays queued
                    break
                yield getter.result()
            if overflow:
                raise RuntimeError(f"replica {self.replica}: {overflow[0]}")
            while not queue.empty():
                yield queue.get_nowait()
            yield task.result()  # raises the request's error
        finally:
            self._requests.pop(msg.request_id, None)
            if getter is not None and not getter.done():
                getter.cancel()
            if not task.done():
                task.cancel()  # the driver went away: drop the request in the stage

    def abort(self, request_id: str) -> None:
        """Cancel the request (its submit ends, the stage drops it), or, one that finished,
        release what the stage emitted for it."""
        task = self._requests.get(request_id)
        if task is not None and not task.done():
            task.cancel()  # the StageClient sends the stage its Abort
        elif self.client is not None:
            self.client.cancel(request_id)

    def send_stream(self, msg: Any) -> None:
        """A Credit for one of a final stage's chunks: the caller took it."""
        if self.client is not None:
            self.client.send_stream(msg)

    def set_waiting(self, request_id: str, waiting: bool) -> None:
        """The caller holds the stage's window of chunks (or no longer does): its stall clock
        stops (restarts)."""
        if self.client is not None:
            self.client.set_waiting(request_id, waiting)

    async def watch(self) -> None:
        """Never returns: the driver's pending call fails the moment this actor dies."""
        await asyncio.Event().wait()

    async def stop(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await asyncio.to_thread(client.shutdown)

    async def _exit_when_stage_dies(self, client: StageClient) -> None:
        while client.state != StageState.CLOSED:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if client.state == StageState.DEAD:
                # Its in-flight requests were failed (503) already; Ray restarts the pair.
                logger.error(
                    "stage %d replica %d: its stage process died; exiting so Ray restarts it",
                    self.init.stage.stage_id,
                    self.replica,
                )
                os._exit(1)


def _on_ray_devices(init: StageInit) -> StageInit:
    """The stage runs on the GPUs Ray gave this actor (none on CPU), whatever `devices` says:
    on Ray, `devices` only says how many a replica needs."""
    import ray

    gpus = [str(g) for g in ray.get_gpu_ids()]
    runtime = init.stage.runtime.model_copy(update={"devices": ",".join(gpus) or None})
    stage = init.stage.model_copy(update={"runtime": runtime})
    return dataclasses.replace(init, stage=stage)
