"""The `vllm.endpoint_plugins` factory: our HTTP routes on vLLM's own API server.

Routes attach only when the server runs a stage pipeline (`--stage-config`); listed in
VLLM_PLUGINS on a plain `vllm serve MODEL`, the plugin adds nothing. With --stage-config the
plugin loads even when VLLM_PLUGINS is unset (patches.py, patch 4): the flag is the opt-in.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any


class OmniImagesPlugin:
    name = "omni_images"
    required_tasks = None  # our pipelines serve no vLLM task; always eligible

    def attach_router(self, app: Any) -> None:
        args = getattr(app.state, "args", None)
        if getattr(args, "stage_config", None) is None:
            return
        from vllm_omni_plugin.serving.chat_routes import attach_chat_routes
        from vllm_omni_plugin.serving.routes import no_text_router, router

        app.include_router(router)
        # A pipeline with a chat stage: vLLM registered its text routes; ours takes its chat
        # route's place (same parsing, vLLM's handler, plus speech). Otherwise: clear 400s.
        if not attach_chat_routes(app):
            app.include_router(no_text_router)
        from vllm_omni_plugin.serving.edits_routes import router as edits_router

        app.include_router(edits_router)  # POST /v1/images/edits
        from vllm_omni_plugin.serving.videos_routes import router as videos_router

        app.include_router(videos_router)  # /v1/videos jobs

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        from vllm_omni_plugin.serving.engine_client import OmniEngineClient

        if not isinstance(engine_client, OmniEngineClient):
            return
        if engine_client.serves_text:
            from vllm_omni_plugin.serving.speech_state import init_speech_service

            init_speech_service(engine_client, state, args)  # chat with audio, its metrics
            return
        from vllm_omni_plugin.serving.app_state import init_image_service

        init_image_service(engine_client, state, args)
        from vllm_omni_plugin.serving.videos import init_video_service

        init_video_service(engine_client, state, args)  # video pipelines only


def make_plugin() -> OmniImagesPlugin:
    return OmniImagesPlugin()
