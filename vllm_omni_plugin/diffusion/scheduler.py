"""Step-level batching scheduler.

Each engine step: admit waiting requests (they get encoded and join at this step boundary),
then pick one group of running requests with the same batch key (resolution, CFG on/off) to
advance by one denoising step together. The group is the oldest running request's key (FCFS),
filled in arrival order up to `max_batch_size` images, the memory budget and `max_tokens` (a
request alone above it runs alone). Finished requests leave; their slots are free at the next
step.

With `max_wait_s`, an idle engine holds newly arrived requests until the batch is full or the
oldest has waited that long, so requests arriving close together start (and finish) together.

With a side lane (`prepare_aside`, side_lane.py), an admitted request is `preparing` until the
lane has prepared it, then `running`; a request whose last step ran is `decoding` until the lane
has decoded it. Both count as admitted (batch size, memory budget) while there, aborted ones
too until their result is back, so the lane holds at most what the scheduler admitted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from .errors import DeviceError
from .outputs import GenerationOutput
from .request import RequestState, RequestStatus


@dataclass
class ScheduledBatch:
    prefill: list[RequestState] = field(default_factory=list)  # admitted now: encode + latents
    # Admitted now, prepared on the side lane; they join the denoising once prepared.
    prepare_aside: list[RequestState] = field(default_factory=list)
    denoise: list[RequestState] = field(default_factory=list)  # one step together
    whole: RequestState | None = None  # whole-pipeline adapters: run this request to the end
    # Finished on the side lane since the last step: (request, images, error or None).
    finished_aside: list[tuple[RequestState, list[Image.Image], str | None]] = field(
        default_factory=list
    )

    def __bool__(self) -> bool:
        return bool(
            self.prefill or self.prepare_aside or self.denoise or self.whole or self.finished_aside
        )


@dataclass
class RunnerOutput:
    finished: dict[str, list[Image.Image]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    # Streaming previews decoded this step: request id -> (partial image index, images).
    previews: dict[str, tuple[int, list[Image.Image]]] = field(default_factory=dict)
    # Requests whose last step ran, handed to the side lane to decode.
    decoding: set[str] = field(default_factory=set)


@dataclass
class SideResult:
    """What the side lane (side_lane.py) did with one job's requests."""

    phase: str
    states: list[RequestState]
    images: dict[str, list[Image.Image]] = field(default_factory=dict)  # decode
    failed: dict[str, str] = field(default_factory=dict)  # request id -> error
    device_error: DeviceError | None = None
    ready: Any = None  # CUDA: an event after the job's work (already passed)


class Scheduler:
    def __init__(
        self,
        max_batch_size: int,
        batch_key: Callable[[RequestState], Hashable],
        cost: Callable[[RequestState], int] | None = None,
        budget: int | None = None,
        tokens: Callable[[RequestState], int] | None = None,
        max_tokens: int | None = None,
        step_batched: bool = True,
        max_wait_s: float = 0.0,
        admit: Callable[[RequestState], bool] | None = None,
        prepare_aside: Callable[[RequestState], bool] | None = None,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.batch_key = batch_key
        self.cost = cost  # activation bytes a request adds to one forward
        self.budget = budget  # activation bytes one forward may use (None = unlimited)
        self.tokens = tokens  # sequence tokens a request adds to one forward (all its rows)
        self.max_tokens = max_tokens  # of one forward, unless a request alone has more
        self.step_batched = step_batched
        self.max_wait_s = max_wait_s
        # False: the request cannot start yet (its LoRA adapters find no free device slot); it
        # keeps its place at the head of the queue.
        self.admit = admit or (lambda state: True)
        # Whether an admitted request is prepared on the side lane (None: there is none).
        self.prepare_aside = prepare_aside
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.preparing: list[RequestState] = []  # on the side lane
        self.decoding: list[RequestState] = []  # on the side lane
        self._aborted: list[RequestState] = []

    def add(self, state: RequestState) -> None:
        self.waiting.append(state)

    def abort(self, request_id: str) -> bool:
        for queue in (self.waiting, self.running):
            for s in list(queue):
                if s.request_id == request_id:
                    queue.remove(s)
                    s.status = RequestStatus.FINISHED  # a step in flight must not emit it again
                    self._aborted.append(s)
                    return True
        # On the side lane: it stays counted until its job's result is back, then is dropped.
        for s in (*self.preparing, *self.decoding):
            if s.request_id == request_id and s.status is not RequestStatus.FINISHED:
                s.status = RequestStatus.FINISHED
                self._aborted.append(s)
                return True
        return False

    def live(self) -> list[RequestState]:
        """Every request held and not aborted: running, waiting, on the side lane."""
        found = (*self.running, *self.waiting, *self.preparing, *self.decoding)
        return [s for s in found if s.status is not RequestStatus.FINISHED]

    def find(self, request_id: str) -> RequestState | None:
        for s in self.live():
            if s.request_id == request_id:
                return s
        return None

    def has_unfinished(self) -> bool:
        return bool(
            self.waiting or self.running or self.preparing or self.decoding or self._aborted
        )

    def _admitted(self) -> list[RequestState]:
        return [*self.running, *self.preparing, *self.decoding]

    def hold_s(self, now: float | None = None) -> float:
        """Seconds the waiting requests are still held for others to join (0: not held).

        Only an idle step-batched engine holds: once requests run, newcomers join at the next
        step boundary anyway.
        """
        if self.max_wait_s <= 0 or not self.step_batched or not self.waiting:
            return 0.0
        if self.running or self.preparing:
            return 0.0
        if sum(s.n for s in self.waiting) >= self.max_batch_size:
            return 0.0
        if self.max_tokens is not None and self.tokens is not None:
            if sum(self.tokens(s) for s in self.waiting) >= self.max_tokens:
                return 0.0  # full by tokens: nothing more can join
        now = time.perf_counter() if now is None else now
        return max(0.0, self.waiting[0].arrival + self.max_wait_s - now)

    def _fits(self, group: list[RequestState], state: RequestState) -> bool:
        if sum(s.n for s in group) + state.n > self.max_batch_size:
            return False
        if group and self.max_tokens is not None and self.tokens is not None:
            if sum(self.tokens(s) for s in group) + self.tokens(state) > self.max_tokens:
                return False
        if self.budget is None or self.cost is None:
            return True
        return sum(self.cost(s) for s in group) + self.cost(state) <= self.budget

    def schedule(self, side_done: Iterable[SideResult] = ()) -> ScheduledBatch:
        """The next step's work; `side_done`: what the side lane finished since the last step."""
        batch = ScheduledBatch()
        for result in side_done:
            self._take(result, batch)
        if not self.step_batched:
            if self.waiting:
                state = self.waiting.popleft()
                state.status = RequestStatus.RUNNING
                state.started = time.perf_counter()
                self.running.append(state)
                batch.whole = state
            return batch
        if self.hold_s() > 0:
            return batch
        # Admit in arrival order while the admitted requests still fit one forward; new requests
        # join the denoising loop at this step boundary (or once the side lane prepared them).
        while (
            self.waiting
            and self._fits(self._admitted(), self.waiting[0])
            and self.admit(self.waiting[0])
        ):
            state = self.waiting.popleft()
            state.status = RequestStatus.RUNNING
            state.started = time.perf_counter()
            if self.prepare_aside is not None and self.prepare_aside(state):
                self.preparing.append(state)
                batch.prepare_aside.append(state)
            else:
                self.running.append(state)
                batch.prefill.append(state)
        if self.running:
            key = self.batch_key(self.running[0])
            for s in self.running:
                if self.batch_key(s) == key and self._fits(batch.denoise, s):
                    batch.denoise.append(s)
        return batch

    def _take(self, result: SideResult, batch: ScheduledBatch) -> None:
        """A side-lane result: prepared requests start denoising, decoded ones are emitted by
        `update`; aborted ones are dropped with what they hold."""
        held = self.preparing if result.phase == "prepare" else self.decoding
        for s in result.states:
            held.remove(s)
            if s.status is RequestStatus.FINISHED:  # aborted meanwhile: "aborted" was emitted
                s.latents = s.x0 = None
                s.cond.clear()
                continue
            error = result.failed.get(s.request_id)
            if result.phase == "prepare" and error is None:
                self.running.append(s)
            else:
                batch.finished_aside.append((s, result.images.get(s.request_id, []), error))

    def update(self, batch: ScheduledBatch, out: RunnerOutput) -> list[GenerationOutput]:
        outputs = [self._output(s, [], "aborted") for s in self._aborted]
        self._aborted.clear()
        for s, images, error in batch.finished_aside:
            s.status = RequestStatus.FINISHED
            outputs.append(self._output(s, images, error))
        rows = sum(s.n for s in batch.denoise)
        for s in batch.denoise:
            if s.request_id not in out.failed and s.status is RequestStatus.RUNNING:
                s.step += 1
                s.batch_sizes.append(rows)
        done = [*batch.prefill, *batch.prepare_aside, *batch.denoise]
        done += [batch.whole] if batch.whole else []
        for s in dict.fromkeys(done):
            rid = s.request_id
            if rid in out.decoding:  # on the side lane now (aborted or not: its job holds it)
                self._leave(s)
                self.decoding.append(s)
                continue
            if rid in out.finished or rid in out.failed:
                self._leave(s)
                if s.status is not RequestStatus.FINISHED:  # else aborted while the step ran
                    s.status = RequestStatus.FINISHED
                    outputs.append(self._output(s, out.finished.get(rid, []), out.failed.get(rid)))
        return outputs

    def _leave(self, s: RequestState) -> None:
        for held in (self.running, self.preparing):
            if s in held:
                held.remove(s)

    @staticmethod
    def _output(s: RequestState, images: list[Image.Image], error: str | None) -> GenerationOutput:
        now = time.perf_counter()
        sizes = s.batch_sizes or [0]
        metrics = {
            "seed": s.seed,
            "steps": s.step,
            "total_steps": s.total_steps,
            "queue_s": (s.started or now) - s.arrival,
            "total_s": now - s.arrival,
            "max_batch": max(sizes),
            "mean_batch": sum(sizes) / len(sizes),
            "prepare_s": s.prepare_s,
            "decode_s": s.decode_s,
            **({"preview_s": s.preview_s} if s.preview_at else {}),
            # Step caching: its policy and the steps whose transformer call it skipped.
            **(
                {"cache_policy": s.step_cache.policy.policy, "cache_skipped": s.step_cache.skipped}
                if s.step_cache is not None
                else {}
            ),
        }
        return GenerationOutput(s.request_id, images, error, metrics)
