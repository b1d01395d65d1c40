"""Step-level batching scheduler.

Each engine step: admit waiting requests (they get encoded and join at this step boundary),
then pick one group of running requests with the same batch key (resolution, CFG on/off) to
advance by one denoising step together. The group is the oldest running request's key (FCFS),
filled in arrival order up to `max_batch_size` images and the memory budget. Finished requests
leave; their slots are free at the next step.

With `max_wait_s`, an idle engine holds newly arrived requests until the batch is full or the
oldest has waited that long, so requests arriving close together start (and finish) together.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from PIL import Image

from .outputs import GenerationOutput
from .request import RequestState, RequestStatus


@dataclass
class ScheduledBatch:
    prefill: list[RequestState] = field(default_factory=list)  # admitted now: encode + latents
    denoise: list[RequestState] = field(default_factory=list)  # one step together
    whole: RequestState | None = None  # whole-pipeline adapters: run this request to the end

    def __bool__(self) -> bool:
        return bool(self.prefill or self.denoise or self.whole)


@dataclass
class RunnerOutput:
    finished: dict[str, list[Image.Image]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    # Streaming previews decoded this step: request id -> (partial image index, images).
    previews: dict[str, tuple[int, list[Image.Image]]] = field(default_factory=dict)


class Scheduler:
    def __init__(
        self,
        max_batch_size: int,
        batch_key: Callable[[RequestState], Hashable],
        cost: Callable[[RequestState], int] | None = None,
        budget: int | None = None,
        step_batched: bool = True,
        max_wait_s: float = 0.0,
        admit: Callable[[RequestState], bool] | None = None,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.batch_key = batch_key
        self.cost = cost  # activation bytes a request adds to one forward
        self.budget = budget  # activation bytes one forward may use (None = unlimited)
        self.step_batched = step_batched
        self.max_wait_s = max_wait_s
        # False: the request cannot start yet (its LoRA adapters find no free device slot); it
        # keeps its place at the head of the queue.
        self.admit = admit or (lambda state: True)
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
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
        return False

    def find(self, request_id: str) -> RequestState | None:
        for s in (*self.running, *self.waiting):
            if s.request_id == request_id:
                return s
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._aborted)

    def hold_s(self, now: float | None = None) -> float:
        """Seconds the waiting requests are still held for others to join (0: not held).

        Only an idle step-batched engine holds: once requests run, newcomers join at the next
        step boundary anyway.
        """
        if self.max_wait_s <= 0 or not self.step_batched or self.running or not self.waiting:
            return 0.0
        if sum(s.n for s in self.waiting) >= self.max_batch_size:
            return 0.0
        now = time.perf_counter() if now is None else now
        return max(0.0, self.waiting[0].arrival + self.max_wait_s - now)

    def _fits(self, group: list[RequestState], state: RequestState) -> bool:
        if sum(s.n for s in group) + state.n > self.max_batch_size:
            return False
        if self.budget is None or self.cost is None:
            return True
        return sum(self.cost(s) for s in group) + self.cost(state) <= self.budget

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
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
        # Admit in arrival order while the running set still fits one forward; new requests
        # join the denoising loop at this step boundary.
        while (
            self.waiting
            and self._fits(self.running, self.waiting[0])
            and self.admit(self.waiting[0])
        ):
            state = self.waiting.popleft()
            state.status = RequestStatus.RUNNING
            state.started = time.perf_counter()
            self.running.append(state)
            batch.prefill.append(state)
        if self.running:
            key = self.batch_key(self.running[0])
            for s in self.running:
                if self.batch_key(s) == key and self._fits(batch.denoise, s):
                    batch.denoise.append(s)
        return batch

    def update(self, batch: ScheduledBatch, out: RunnerOutput) -> list[GenerationOutput]:
        outputs = [self._output(s, [], "aborted") for s in self._aborted]
        self._aborted.clear()
        rows = sum(s.n for s in batch.denoise)
        for s in batch.denoise:
            if s.request_id not in out.failed and s.status is RequestStatus.RUNNING:
                s.step += 1
                s.batch_sizes.append(rows)
        done = [*batch.prefill, *batch.denoise] + ([batch.whole] if batch.whole else [])
        for s in dict.fromkeys(done):
            rid = s.request_id
            if s.status is RequestStatus.FINISHED:
                continue  # aborted while the step ran
            if rid in out.finished or rid in out.failed:
                if s in self.running:
                    self.running.remove(s)
                s.status = RequestStatus.FINISHED
                outputs.append(self._output(s, out.finished.get(rid, []), out.failed.get(rid)))
        return outputs

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
