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
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any

from ..common.messages import Result, Submit
from ..config.stage_init import StageInit
from .errors import StageUnavailableError
from .handle import StageState
from .stage_client import StageClient

logger = logging.getLogger("vllm_omni_plugin.orchestrator.ray")

WATCH_INTERVAL_S = 0.2


class StageReplicaActor:
    """Created with `ray.remote(StageReplicaActor).options(...)` by ray_backend.py."""

    def __init__(self, init: StageInit, replica: int, startup_timeout_s: float):
        self.init = init
        self.replica = replica
        self.startup_timeout_s = startup_timeout_s
        self.client: StageClient | None = None
        self._starting: asyncio.Lock | None = None

    async def start(self) -> dict[str, Any]:
        """Spawn the stage process (once per actor life) and describe the replica."""
        import ray

        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self.client is None:
                client = StageClient(
                    _on_ray_devices(self.init),
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
        }

    async def submit(self, msg: Submit) -> Result:
        if self.client is None:
            raise StageUnavailableError(f"replica {self.replica} has no stage process yet")
        return await self.client.submit(msg)

    def abort(self, request_id: str) -> None:
        if self.client is not None:
            self.client.cancel(request_id)

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
