"""App state for vLLM's server in stage-config mode (what `init_app_state` sets otherwise).

vLLM's shared routes read: `engine_client` (/health, /kv_event_sources, the watchdog),
`openai_serving_models` (/v1/models), `args`, `vllm_config`, `log_stats`, and the server-load
fields (/load). Our own routes read `omni_images` (set by the endpoint plugin's init_state).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from .admission import Admission
from .deferred_limits import limits_or_deferred
from .engine_client import OmniEngineClient
from .handlers import ImageService
from .metrics import OmniCollector, register


class _Card:
    def __init__(self, data: dict[str, Any]):
        self._data = data

    def model_dump(self) -> dict[str, Any]:
        return self._data


class PipelineModels:
    """/v1/models for a pipeline: one card per served name, rooted at the pipeline folder."""

    def __init__(self, names: list[str], root: str, pipeline: str):
        self.names = names
        self.root = root
        self.pipeline = pipeline
        self.created = int(time.time())

    async def show_available_models(self) -> _Card:
        cards = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm-omni-plugin",
                "root": self.root,
                "parent": None,
                "max_model_len": None,
                "pipeline": self.pipeline,
                "permission": [],
            }
            for name in self.names
        ]
        return _Card({"object": "list", "data": cards})


def served_names(client: OmniEngineClient, args: argparse.Namespace) -> list[str]:
    return list(args.served_model_name or [str(client.cfg.model)])


async def init_omni_app_state(
    client: OmniEngineClient, state: Any, args: argparse.Namespace
) -> None:
    """What vLLM's init_app_state sets for the shared routes; the caller (entry_points/patches.py,
    which knows where this vLLM keeps it) then runs the endpoint plugins' state hook."""
    state.engine_client = client
    state.args = args
    state.vllm_config = client.vllm_config
    state.log_stats = False
    state.openai_serving_models = PipelineModels(
        served_names(client, args), str(client.cfg.model), client.cfg.pipeline
    )
    state.enable_server_load_tracking = getattr(args, "enable_server_load_tracking", False)
    state.server_load_metrics = 0


def running_capacity(cfg: Any) -> int:
    """Requests that run at once: the final stage's batch (max_batch_size) in each replica."""
    final = cfg.final_stage
    batch = final.diffusion.max_batch_size if getattr(final, "diffusion", None) else 1
    return batch * final.num_replicas


def init_image_service(client: OmniEngineClient, state: Any, args: argparse.Namespace) -> None:
    """Called by the endpoint plugin: the handler state behind /v1/images/*."""
    orchestrator = client.orchestrator
    serving = getattr(client.cfg, "serving", None)
    queued = serving.max_queued_requests if serving is not None else 32
    service = ImageService(
        orchestrator,
        # Deferred while a remote final stage has not registered (multi-node heads).
        limits_or_deferred(orchestrator, getattr(client.cfg, "serving", None)),
        served_names(client, args),
        pipeline=client.cfg.pipeline,
        request_timeout_s=getattr(serving, "request_timeout_s", None),
        admission=Admission(running_capacity(client.cfg), queued, "serving.max_queued_requests"),
        edit_url_hosts=tuple(getattr(serving, "edit_url_hosts", ())),
    )
    state.omni_images = service
    register(OmniCollector(orchestrator, service, client.cfg.pipeline))
