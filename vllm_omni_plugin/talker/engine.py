"""The talker as a batched generation engine: thinker text in, codec frames out, per request.

    engine.add_request(rid, prompt_ids, speaker="ethan", max_frames=64)
    engine.add_text(rid, ids, finished=False)   # the thinker's generated ids as they come
    out = engine.step()                          # TalkerOutput(rid, codes [G, n], finished)

A request prefills once the thinker's first token is known and a cache slot is free (at most
`max_batch_size` requests hold one), then takes one decode step per engine step, all ready
requests in one batch, each step emitting one complete frame (all code groups). On a GPU the
decode step replays a CUDA graph (graphs.py) unless `enforce_eager`. Decode step k adds the
thinker's generated token k + 1 (projected) to the talker's input, so a request waits while the
thinker has not written it yet; once the thinker finished, `tts_eos` and then `tts_pad` follow
(as transformers' `generate` conditions it). Greedy (the parity setting); a request ends at the
codec EOS or after `max_frames` frames.

Thread-safe for add_request / add_text / abort from other threads while one thread steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..common.request_table import RequestTable
from .graphs import DecodeGraphs
from .prompt import TalkerConditioner
from .runner import TalkerRunner, load_talker

# Most padded prompt positions one prefill batch holds (its attention mask is batch x this^2).
PREFILL_TOKENS = 8192


class TalkerPromptError(ValueError):
    """A prompt the talker cannot speak for (see TalkerConditioner.check_prompt)."""


class TalkerCapacityError(RuntimeError):
    """More requests than `max_requests` at once."""


@dataclass
class TalkerOutput:
    request_id: str
    #: `[num_code_groups, n]` int64: the frames completed in this step (n is 0 or 1)
    codes: torch.Tensor
    #: the request's last output
    finished: bool


@dataclass
class _Request:
    prompt_ids: list[int]
    speaker_id: int
    max_frames: int
    prompt_hidden: torch.Tensor | None
    text_ids: list[int] = field(default_factory=list)
    text_finished: bool = False
    trailing: torch.Tensor | None = None  # projected entries known so far
    slot: int | None = None  # its cache slot, once prefilled
    length: int = 0  # positions in its cache slot
    last_hidden: torch.Tensor | None = None
    code0: int | None = None
    frames: int = 0
    held: bool = False  # its reader is behind: no decode steps until released


class TalkerEngine(RequestTable):
    def __init__(
        self,
        model: str,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 64,
        max_requests: int = 256,
        enforce_eager: bool = False,
        max_model_len: int | None = None,
    ):
        """`max_model_len`: most positions one request takes in the KV cache (its prompt's
        user-turn ids, the assistant head, its frames); a request that could pass it is refused
        on arrival, and the cache never grows past it. None: no bound."""
        if max_batch_size < 1 or max_requests < 1:
            raise ValueError("max_batch_size and max_requests must be >= 1")
        super().__init__()
        config, talker, embed = load_talker(model, device, dtype)
        self.config = config
        self.runner = TalkerRunner(config, talker, max_batch_size, max_model_len)
        graphed = self.runner.device.type == "cuda" and not enforce_eager
        self._decode = self.runner.decode
        if graphed:
            self._decode = DecodeGraphs(self.runner, max_batch_size)
            self._decode.capture_all()
        self._in_cache: dict[str, _Request] = {}  # the stepping thread's own view
        self.conditioner = TalkerConditioner(config, embed, talker)
        self.speakers = dict(config.talker_config.speaker_id or {})
        self.max_requests = max_requests

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        speaker: str = "ethan",
        max_frames: int = 4096,
        prompt_hidden: torch.Tensor | None = None,
    ) -> None:
        """`prompt_hidden`: the thinker's `[L, H]` hidden states at `accept_hidden_layer` for
        the prompt (needed where the prompt has audio / image / video placeholders)."""
        speaker_id = self.speakers.get(speaker.lower())
        if speaker_id is None:
            raise ValueError(
                f"unknown voice {speaker!r}; this checkpoint has {sorted(self.speakers)}"
            )
        if max_frames < 1:
            raise ValueError("max_frames must be >= 1")
        try:
            self.conditioner.check_prompt(prompt_ids, prompt_hidden is not None)
        except ValueError as exc:
            raise TalkerPromptError(str(exc)) from None
        positions = self.conditioner.prefill_length(prompt_ids) + max_frames
        limit = self.runner.cache.limit
        if limit is not None and positions > limit:
            raise TalkerPromptError(
                f"the prompt and up to {max_frames} frames need {positions} talker positions; "
                f"its max_model_len is {limit}"
            )
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already in the talker")
            if len(self._requests) >= self.max_requests:
                raise TalkerCapacityError(f"talker holds {self.max_requests} requests")
            self._requests[request_id] = _Request(
                list(prompt_ids), speaker_id, max_frames, prompt_hidden
            )

    def add_text(self, request_id: str, ids: list[int], finished: bool = False) -> bool:
        """Append thinker ids; False (nothing done) when the request already ended here (its
        frame cap or codec EOS came before the thinker's end) or was aborted."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                return False
            if req.text_finished:
                raise ValueError(f"request {request_id!r}: the thinker's text already ended")
            req.text_ids.extend(int(i) for i in ids)
            req.text_finished = finished
            return True

    def step(self) -> list[TalkerOutput]:
        """Prefill the requests whose first token arrived, then one batched decode step."""
        outputs: list[TalkerOutput] = []
        with self._lock:
            items = list(self._requests.items())
            for rid, req in list(self._in_cache.items()):  # ended or aborted since
                if self._requests.get(rid) is not req:
                    self._release(rid)
        r = self.runner
        ready = [(rid, req) for rid, req in items if req.slot is None and req.text_ids]
        for group in _prefill_groups(ready[: r.cache.free_slots]):
            self._prefill(group)
            for rid, req in group:
                if req.code0 == r.eos:  # the talker ends before its first frame
                    with self._lock:
                        if self._requests.get(rid) is req:
                            del self._requests[rid]
                            empty = torch.zeros(r.num_groups, 0, dtype=torch.long)
                            outputs.append(TalkerOutput(rid, empty, True))
        batch, texts = [], []
        for rid, req in items:
            if req.slot is None or req.code0 == r.eos or req.held:
                continue
            entry = self._text_entry(req)
            if entry is None:
                continue  # waits for the thinker's next token
            batch.append((rid, req))
            texts.append(entry)
        if not batch:
            return outputs
        r.reserve(max(req.length for _, req in batch) + 1)
        frames, hidden, codes = self._decode(
            torch.stack([req.last_hidden for _, req in batch]),
            torch.tensor([req.code0 for _, req in batch], device=r.device),
            torch.stack(texts),
            torch.tensor([req.slot for _, req in batch], device=r.device),
            torch.tensor([req.length for _, req in batch], device=r.device),
        )
        frames, codes = frames.cpu(), codes.cpu()
        with self._lock:
            for i, (rid, req) in enumerate(batch):
                req.length += 1
                if self._requests.get(rid) is not req:
                    continue
                req.frames += 1
                req.last_hidden, req.code0 = hidden[i], int(codes[i])
                done = req.frames >= req.max_frames or req.code0 == r.eos
                outputs.append(TalkerOutput(rid, frames[i][:, None], done))
                if done:
                    del self._requests[rid]
                    self._release(rid)
        return outputs

    def _prefill(self, group: list[tuple[str, _Request]]) -> None:
        c, r = self.conditioner, self.runner
        embeds = [
            c.prefill(req.prompt_ids, req.text_ids[0], req.speaker_id, req.prompt_hidden)
            for _, req in group
        ]
        slots = [r.cache.acquire() for _ in group]
        hidden, codes = r.prefill(embeds, slots)
        for i, (rid, req) in enumerate(group):
            self._in_cache[rid] = req
            req.slot, req.length = slots[i], embeds[i].shape[0]
            req.last_hidden, req.code0 = hidden[i], codes[i]

    def _release(self, rid: str) -> None:
        req = self._in_cache.pop(rid)
        self.runner.cache.release(req.slot)

    def _text_entry(self, req: _Request) -> torch.Tensor | None:
        """The trailing text entry of the request's next decode step, or None to wait."""
        k = req.frames  # decode step k reads entry k: generated token k + 1
        c = self.conditioner
        if k + 1 < len(req.text_ids):
            known = 0 if req.trailing is None else req.trailing.shape[0]
            if known < len(req.text_ids) - 1:  # project only the ids that arrived since
                new = c.trailing(req.text_ids[known:])
                req.trailing = new if req.trailing is None else torch.cat([req.trailing, new])
            return req.trailing[k]
        if not req.text_finished:
            return None
        return c.tts_eos if k + 1 == len(req.text_ids) else c.tts_pad


def _prefill_groups(ready: list[tuple[str, _Request]]) -> list[list[tuple[str, _Request]]]:
    """Requests to prefill, in arrival order, grouped so that a group's padded batch (its size x
    its longest prompt) stays within PREFILL_TOKENS; a longer prompt goes alone."""
    groups: list[list[tuple[str, _Request]]] = []
    longest = 0
    for item in ready:
        # An upper bound of its prefill (user-turn ids + the 9-entry head) from the ids alone.
        n = len(item[1].prompt_ids) + 16
        if groups and (len(groups[-1]) + 1) * max(longest, n) <= PREFILL_TOKENS:
            groups[-1].append(item)
            longest = max(longest, n)
        else:
            groups.append([item])
            longest = n
    return groups
