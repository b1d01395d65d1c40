"""What ran when: the engine's latest phase spans (prepare, denoise, preview, decode), each with
the lane it ran on ("engine": the thread driving `step()`; "side": the side lane's worker) and
the requests it served.

Host clock (`time.perf_counter`, one clock for every thread). On CUDA a span is the host side of
the phase: its launches, and its waits where it reads results back (a decode's images); on the
CPU it is the work itself. Bounded: the oldest spans are dropped.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

ENGINE_LANE = "engine"
SIDE_LANE = "side"


@dataclass(frozen=True)
class PhaseSpan:
    phase: str  # "prepare" | "denoise" | "preview" | "decode"
    lane: str  # ENGINE_LANE | SIDE_LANE
    request_ids: tuple[str, ...]
    start: float
    end: float


class PhaseLog:
    def __init__(self, keep: int = 1024) -> None:
        self._spans: deque[PhaseSpan] = deque(maxlen=keep)
        self._lock = threading.Lock()  # both lanes append; readers copy

    @contextmanager
    def span(self, phase: str, lane: str, states: Sequence[Any]) -> Iterator[None]:
        """Record the phase around the block, whether it returns or raises."""
        ids = tuple(s.request_id for s in states)
        start = time.perf_counter()
        try:
            yield
        finally:
            span = PhaseSpan(phase, lane, ids, start, time.perf_counter())
            with self._lock:
                self._spans.append(span)

    def spans(self) -> list[PhaseSpan]:
        with self._lock:
            return list(self._spans)
