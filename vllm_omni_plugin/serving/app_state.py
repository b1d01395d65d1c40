"""App state for vLLM's server in stage-config mode (what `init_app_state` sets otherwise).

vLLM's shared routes read: `engine_client` (/health, /kv_event_sources, the watchdog),
`openai_serving_models` (/v1/models), `args`, `vllm_config`, `log_stats`, and the server-load
fields (/load). Our own routes read `omni_images` (set by the endpoint plugin's init_state).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..common.lora_files import LoraError
from .admission import Admission
from .deferred_limits import limits_or_deferred
from .engine_client import OmniEngineClient
from .errors import APIError
from .handlers import ImageService
from .lora_adapters import LoraAdapters
from .metrics import OmniCollector, register


class _Card:
    def __init__(self, data: dict[str, Any]):
        self._data = data

    def model_dump(self) -> dict[str, Any]:
        return self._data


class PipelineModels:
    """/v1/models for a pipeline: one card per served name, rooted at the pipeline folder,
    and one per served LoRA adapter (parent: the first served name). vLLM's runtime LoRA
    routes (on with VLLM_ALLOW_RUNTIME_LORA_UPDATING) call load/unload_lora_adapter here."""

    def __init__(
        self, names: list[str], root: str, pipeline: str, lora: LoraAdapters | None = None
    ):
        self.names = names
        self.root = root
        self.pipeline = pipeline
        self.lora = lora
        self.created = int(time.time())

    def _adapter_cards(self) -> list[dict[str, Any]]:
        registry = self.lora.registry() if self.lora is not None else None
        if registry is None:
            return []
        return [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm-omni-plugin",
                "root": folder,
                "parent": self.names[0] if self.names else None,
                "max_model_len": None,
                "permission": [],
            }
            for name, folder in registry.served().items()
        ]

    async def load_lora_adapter(self, request: Any, base_model_name: str | None = None) -> Any:
        """POST /v1/load_lora_adapter {lora_name, lora_path[, load_inplace]}: the adapter's
        files checked against the diffusion stage's model, then served; 4xx, nothing loaded."""
        return self._lora_change(
            lambda r: r.load(request.lora_name, request.lora_path, request.load_inplace),
            request.lora_name,
            "added",
        )

    async def unload_lora_adapter(self, request: Any) -> Any:
        """POST /v1/unload_lora_adapter {lora_name}: requests may no longer name it."""
        return self._lora_change(
            lambda r: r.unload(request.lora_name), request.lora_name, "removed"
        )

    def _lora_change(self, change: Any, name: str, done: str) -> Any:
        if name in self.names:
            return vllm_error(400, f"the LoRA adapter {name!r} conflicts with a served model name")
        try:
            registry = self.lora.require() if self.lora is not None else None
            if registry is None:
                raise APIError(400, "this server has no LoRA registry")
            change(registry)
        except LoraError as exc:
            return vllm_error(exc.status, exc.message, exc.field)
        except APIError as exc:
            return vllm_error(exc.status, exc.message, exc.param)
        return f"Success: LoRA adapter '{name}' {done} successfully."

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
        return _Card({"object": "list", "data": cards + self._adapter_cards()})


def vllm_error(status: int, message: str, param: str | None = None) -> Any:
    """vLLM's ErrorResponse (what its LoRA routes answer with, in OpenAI's error shape)."""
    import importlib

    try:  # vLLM >= 0.29
        protocol = importlib.import_module("vllm.entrypoints.serve.engine.protocol")
    except ImportError:  # pragma: no cover - vLLM 0.26-0.28 keep it here
        protocol = importlib.import_module("vllm.entrypoints.openai.engine.protocol")
    ErrorInfo, ErrorResponse = protocol.ErrorInfo, protocol.ErrorResponse  # noqa: N806
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))


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
    # One registry of LoRA adapters for /v1/models, the runtime load routes and every route.
    state.omni_lora = LoraAdapters(client.orchestrator)
    state.openai_serving_models = PipelineModels(
        served_names(client, args), str(client.cfg.model), client.cfg.pipeline, state.omni_lora
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
        lora=getattr(state, "omni_lora", None),
    )
    state.omni_images = service
    register(OmniCollector(orchestrator, service, client.cfg.pipeline))
