"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error the HTTP layer answers as is. `code` is OpenAI's machine-readable string."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}  # e.g. Retry-After on a 429
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _default_type(status)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Any:
        """The JSON response: this error's body, status and headers."""
        from fastapi.responses import JSONResponse

        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable_error"
    if 400 <= status < 500:
        return "invalid_request_error"
    return "server_error"


def invalid(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str) -> APIError:
    return APIError(503, message, code="stage_unavailable")
