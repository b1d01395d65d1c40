"""The requests of a batched engine stepped in one thread while others add, hold and abort
them (the Code2Wav stage's engine): one table, one lock."""

from __future__ import annotations

import threading
from typing import Any


class RequestTable:
    def __init__(self) -> None:
        self._requests: dict[str, Any] = {}  # id -> the engine's request (has `held`)
        self._lock = threading.Lock()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._requests.pop(request_id, None)

    def hold(self, request_id: str, held: bool) -> None:
        """Pause (or resume) a request's steps: back-pressure from its reader."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is not None:
                req.held = held

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._requests)
