"""Which backend runs a deployment's stages, chosen once from its config and serve arguments.

* local (the default): every stage a child process of this API server (stage_client.py);
* head of headless nodes (`--stage-ids` + `--omni-master-port`): the stages not listed run on
  nodes that register with this server (remote.py);
* Ray (`runtime: {backend: ray}`): every stage a set of Ray actors (ray_backend.py).

`running_orchestrator` builds the Orchestrator on the chosen backend, starts it, and on exit
stops the stages and the backend, whatever happened in between.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from .orchestrator import DEFAULT_STARTUP_TIMEOUT_S, STARTUP_TIMEOUT_ENV, Orchestrator
from .ray_backend import RayBackend, uses_ray
from .remote import head_from_args


@asynccontextmanager
async def running_orchestrator(cfg: Any, args: argparse.Namespace) -> AsyncIterator[Orchestrator]:
    """The started Orchestrator of `cfg` on its backend (SystemExit for a contradictory one)."""
    timeout = float(os.environ.get(STARTUP_TIMEOUT_ENV, DEFAULT_STARTUP_TIMEOUT_S))
    head = head_from_args(cfg, args)  # None on a single node
    factory = head.stage_factory(timeout) if head is not None else None
    ray_backend = None
    if uses_ray(cfg):
        if head is not None:
            raise SystemExit(
                "runtime.backend: ray places every stage on the Ray cluster; drop --stage-ids "
                "and --omni-master-port (headless nodes are the other way to spread stages)"
            )
        ray_backend = RayBackend(cfg, timeout)
        factory = ray_backend.stage_factory
    orchestrator = Orchestrator(cfg, startup_timeout_s=timeout, stage_factory=factory)
    try:
        if ray_backend is not None:
            await ray_backend.connect()
        if head is not None:
            await head.start()
        await orchestrator.start()
        yield orchestrator
    finally:
        # Not `shutdown()`: stopping stages takes seconds and must not block the event loop.
        await orchestrator.aclose()
        if head is not None:
            head.close()
        if ray_backend is not None:
            ray_backend.close()
