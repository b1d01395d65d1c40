"""Order between the engine's CUDA stream and the side lane's, where requests change hands.

Work queued on two CUDA streams runs in no particular order unless one waits on an event of
the other, and the caching allocator hands a freed block straight to later work of the stream
that allocated it. So at each handoff:

  * prepare -> denoise: the side lane records an event after a request's prepare and reports
    the request ready only once that event has passed (it waits on the host, on its own thread);
    the engine's stream then waits on the event before anything it queues next, so the request's
    first denoising step reads finished embeddings and latents, by CUDA's ordering, not by timing.
  * denoise -> decode: the engine records an event after the request's last denoising step; the
    side stream waits on it before decoding the latents.
  * memory: every tensor of a request that crosses is marked with `Tensor.record_stream` for the
    stream it is handed to, so its block is not reused until that stream's work queued before the
    free is done (tensors prepare made and denoising reads and frees; latents denoising made and
    the decode reads).

The waits are queued outside any CUDA graph capture: the engine stream's wait before a step's
forward, the side stream's on the side lane. Graphs are only ever captured and replayed on the
engine's stream.

On the CPU there are no streams and every method is a no-op: an op has finished when it returns.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from .request import RequestState


class StreamHandoff:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.side: Any = None
        if self.cuda:
            # The index of the device the engine runs on: each thread has its own current device.
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            self.side = torch.cuda.Stream(self.device)

    # ---- the side lane's thread ---------------------------------------------------------------
    def enter_side_thread(self) -> None:
        """Make the engine's device this thread's current one (tensors made with `device="cuda"`
        land there, as on the engine thread)."""
        if self.cuda:
            torch.cuda.set_device(self.device)

    def on_side(self) -> AbstractContextManager:
        """Queue the block's work on the side stream."""
        return torch.cuda.stream(self.side) if self.cuda else nullcontext()

    def side_waits(self, event: Any) -> None:
        if event is not None:
            self.side.wait_event(event)

    def side_done(self) -> Any:
        """An event after the side stream's queued work, already passed when this returns."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.side)
        event.synchronize()
        return event

    # ---- the engine's thread ------------------------------------------------------------------
    def engine_stream(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def engine_mark(self) -> Any:
        """An event after the work queued so far on the engine's stream."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def engine_waits(self, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    # ---- either thread ------------------------------------------------------------------------
    def hand_over(self, states: Iterable[RequestState], stream: Any) -> None:
        """Mark the requests' device tensors as used by `stream` (see the module docstring)."""
        if stream is None:
            return
        for state in states:
            for t in request_tensors(state):
                if t.is_cuda:
                    t.record_stream(stream)


def request_tensors(state: RequestState) -> Iterator[torch.Tensor]:
    """The tensors a request holds between phases: latents, schedule, previews' x0, and its
    conditioning (`cond`: embeddings, masks, source-image latents, a per-request scheduler's
    tensors, GLM-Image's per-layer keys and values)."""
    yield from _tensors([state.latents, state.timesteps, state.sigmas, state.x0, state.cond])


def _tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 4 or value is None or isinstance(value, (str, bytes, int, float, bool)):
        return
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v, depth + 1)
    elif hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
        # A per-request object such as Wan's copy of the pipeline's scheduler.
        yield from _tensors(vars(value), depth + 1)
