"""Request validation errors: raised by any stage (an engine's own checks) and by the API
server; each names the request field at fault, which the HTTP layer turns into a 400 that says
it, in OpenAI's error shape."""

from __future__ import annotations


class RequestValidationError(ValueError):
    """A request parameter is invalid; `field` names it (e.g. "height", "num_inference_steps")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class CapacityError(RequestValidationError):
    """The request can never fit the engine's limits (max batch size or memory budget)."""
