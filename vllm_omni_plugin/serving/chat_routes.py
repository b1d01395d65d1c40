"""POST /v1/chat/completions on a pipeline with a chat stage: vLLM's own route, plus speech.

vLLM registers its chat route when the engine client reports the text task (a pipeline with a
chat stage). This module takes that route's place with one that keeps vLLM's request parsing
(the same request class, the same dependencies) and hands every request without speech to
vLLM's own handler unchanged; a request that asks for speech (`modalities` with "audio", or an
`audio` object) goes to the speech service (speech.py), which refuses it with a 400 on a
deployment that does not speak. Before either, `modalities` is checked (vLLM's handler would
ignore a value it does not know) and the request's image, audio and video parts are held to the
deploy file's `serving:` bounds (media_limits.py); before FastAPI parses it the body is read
with a byte limit derived from them (413 past it: `BoundedBodyRoute`).

No `from __future__ import annotations` here: the route's request annotation is vLLM's class,
read from vLLM's own route at attach time, and FastAPI must see the class itself.
"""

import inspect
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from .bodies import read_body
from .errors import APIError
from .speech_request import check_modalities

CHAT_PATH = "/v1/chat/completions"


def take_route(app: Any, path: str, method: str) -> APIRoute | None:
    """Remove and return the app's API route for `method path` (None if it has none)."""
    for route in list(app.router.routes):
        if isinstance(route, APIRoute) and route.path == path and method in route.methods:
            app.router.routes.remove(route)
            return route
    return None


class BoundedBodyRequest(Request):
    """A request whose body is read once, counted against `limit` as it arrives (bodies.py)."""

    limit: int = 0

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            self._body = await read_body(self, self.limit)
        return self._body


class BoundedBodyRoute(APIRoute):
    """vLLM's chat route reads the whole JSON body before any check of ours: this route reads
    it first, at most the largest body the media bounds allow (`MediaLimits.max_body_bytes`), so
    a body of any size cannot be buffered."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def bounded_handler(request: Request):
            limits = getattr(request.app.state, "omni_media_limits", None)
            if limits is None:
                return await handler(request)
            bounded = BoundedBodyRequest(request.scope, request.receive)
            bounded.limit = limits.max_body_bytes
            try:
                await bounded.body()
            except APIError as exc:
                return exc.response()
            return await handler(bounded)

        return bounded_handler


def asks_for_speech(request: Any) -> bool:
    extra = getattr(request, "model_extra", None) or {}
    modalities = extra.get("modalities")
    wants = isinstance(modalities, list) and "audio" in modalities
    return wants or extra.get("audio") is not None


def speech_router(core: APIRoute) -> APIRouter:
    """A router whose chat route parses as vLLM's (`core`) and adds the speech branch."""
    vllm_endpoint = core.endpoint
    request_cls = inspect.signature(vllm_endpoint, eval_str=True).parameters["request"].annotation
    router = APIRouter(route_class=BoundedBodyRoute)

    async def create_chat_completion(request: request_cls, raw_request: Request):  # type: ignore[valid-type]
        service = getattr(raw_request.app.state, "omni_speech", None)
        limits = getattr(raw_request.app.state, "omni_media_limits", None)
        try:
            check_modalities(request)
            if limits is not None:
                await limits.check(getattr(request, "messages", None))
        except APIError as exc:
            if service is not None and asks_for_speech(request):
                service.outcomes[str(exc.status)] += 1
            return exc.response()
        if not asks_for_speech(request):
            return await vllm_endpoint(request=request, raw_request=raw_request)
        if service is None:
            err = APIError(503, "the speech service is not initialised", code="not_ready")
            return JSONResponse(err.body(), status_code=err.status)
        return await service.create(request, raw_request)

    router.add_api_route(
        CHAT_PATH,
        create_chat_completion,
        methods=["POST"],
        dependencies=list(core.dependencies),
        responses=dict(core.responses),
    )
    return router


def attach_chat_routes(app: Any) -> bool:
    """Put the speech-aware chat route in place of vLLM's; False if vLLM registered none."""
    core = take_route(app, CHAT_PATH, "POST")
    if core is None:
        return False
    app.include_router(speech_router(core))
    return True
