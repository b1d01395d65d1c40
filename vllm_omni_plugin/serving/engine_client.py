"""The engine client vLLM's API server holds when it serves a stage pipeline.

vLLM's `build_and_serve` and its shared routes use a small part of the EngineClient surface:
`get_supported_tasks`, `model_config`, `vllm_config.shutdown_timeout`, `check_health` (/health),
`errored`/`is_running` (its watchdog), `shutdown` (on SIGTERM), `get_kv_event_sources`. This
class provides exactly that, backed by the orchestrator, so vLLM's server runs unchanged.

A pipeline with a chat stage (its topology's `chat_stage`, e.g. Qwen3-Omni's thinker) also
serves vLLM's text task: this client then carries that stage's vLLM front end (text_engine.py:
vllm_config, model_config, renderer, input_processor, `generate`), and vLLM's own serving
classes answer /v1/chat/completions and /v1/completions through it.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

from ..config.serve_args import load_config
from ..orchestrator import Orchestrator
from ..orchestrator.backends import running_orchestrator
from ..pipelines import get_pipeline

logger = logging.getLogger("vllm_omni_plugin.serving")


class OmniEngineClient:
    def __init__(
        self,
        orchestrator: Orchestrator,
        cfg: Any,
        args: argparse.Namespace,
        text: Any = None,  # text_engine.TextEngine of the chat stage, if the pipeline has one
    ):
        self.orchestrator = orchestrator
        self.cfg = cfg
        self.args = args
        self.text = text
        if text is not None:
            self.vllm_config = text.vllm_config
            self.model_config = text.model_config
            self.renderer = text.renderer
            self.input_processor = text.input_processor
        else:
            # No vLLM ModelConfig: the pipeline root is not a vLLM model.
            self.model_config = None
            self.vllm_config = SimpleNamespace(
                model_config=None,
                lora_config=None,
                shutdown_timeout=getattr(args, "shutdown_timeout", 0) or 0,
            )
        self._stopped = False

    @property
    def serves_text(self) -> bool:
        return self.text is not None

    # ---- what vLLM's server reads ------------------------------------------------------
    async def get_supported_tasks(self) -> tuple[str, ...]:
        # Without a chat stage no stage produces text, so vLLM's text routes stay unregistered;
        # our endpoint plugin answers /v1/chat/completions and /v1/completions with a clear 400.
        return ("generate",) if self.text is not None else ()

    # ---- vLLM's text task on the chat stage (text_engine.py) ---------------------------------
    def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any):
        if self.text is None:
            raise ValueError(f"pipeline {self.cfg.pipeline} has no stage that writes text")
        return self.text.generate(prompt, sampling_params, request_id, **kwargs)

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        return None  # no admission limits of our own; the stages queue what they take

    async def is_tracing_enabled(self) -> bool:
        return False

    def get_tokenizer(self) -> Any:
        return self.renderer.get_tokenizer()

    async def notify_kv_transfer_request_rejected(self, *args: Any, **kwargs: Any) -> None:
        return None

    @property
    def is_running(self) -> bool:
        return not self._stopped

    @property
    def is_stopped(self) -> bool:
        return self._stopped

    @property
    def errored(self) -> bool:
        # A dead stage is restarted, never fatal: vLLM's watchdog must not stop the server.
        return False

    @property
    def dead_error(self) -> BaseException:
        return RuntimeError(f"stages down: {self.orchestrator.unhealthy_stages()}")

    async def check_health(self) -> None:
        if not self.orchestrator.healthy():
            from vllm.v1.engine.exceptions import EngineDeadError

            raise EngineDeadError(f"stage(s) {self.orchestrator.unhealthy_stages()} are not ready")

    async def do_log_stats(self) -> None:
        return None

    def get_kv_event_sources(self) -> dict:
        return {}

    async def abort(self, request_id: str | Any) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for stage in self.orchestrator.stages.values():
            for rid in ids:
                stage.cancel(rid)

    def shutdown(self, timeout: float | None = None) -> None:
        # vLLM calls this from an executor thread (launcher.serve_http), so blocking is fine;
        # the stages stop concurrently.
        self._stopped = True
        self.orchestrator.shutdown()
        if self.text is not None:
            self.text.shutdown()


def _setup_logging() -> None:
    """vLLM configures only its own `vllm` logger; give ours a handler so stage start-up,
    death and restart lines reach the server log."""
    root = logging.getLogger("vllm_omni_plugin")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter(
                "(omni) %(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S"
            )
        )
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False


@asynccontextmanager
async def omni_engine_client(args: argparse.Namespace) -> AsyncIterator[OmniEngineClient]:
    _setup_logging()
    cfg = load_config(args)
    # The backend (local, head of headless nodes, Ray) is the orchestrator's choice.
    async with running_orchestrator(cfg, args) as orchestrator:
        text = None
        chat_stage = get_pipeline(cfg.pipeline).chat_stage
        if chat_stage is not None:
            from .text_engine import TextEngine

            text = TextEngine(orchestrator, chat_stage)
        yield OmniEngineClient(orchestrator, cfg, args, text)
