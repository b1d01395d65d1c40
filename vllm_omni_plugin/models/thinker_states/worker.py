"""The thinker's hidden states out of vLLM's worker, per request and per step.

`ThinkerStatesWorker` is vLLM's own worker for the platform (CPU or GPU), chosen through
`worker_cls`; after vLLM builds its V1 model runner it makes that runner an instance of a
subclass that adds the extraction (`ThinkerStatesRunnerMixin`). The subclass overrides three
runner methods: `load_model` (choose the capture), `execute_model` (know the step's requests) and
`_model_forward` (the method vLLM's V1 runner documents as the one subclasses override to
inspect a forward pass).

Capture, per decoder-layer input index (see settings.EngineSettings):
- 0: the `inputs_embeds` the runner hands the model (media embeddings merged in), read before
  the forward (the decoder's fused norms may update that buffer in place).
- k >= 1, vLLM >= 0.29: the model's own auxiliary hidden-state outputs (`EagleModelMixin`, the
  EAGLE-3 path), returned by the compiled model, so they survive torch.compile and CUDA graphs.
- k >= 1, older vLLM (its Qwen3-Omni thinker has no auxiliary outputs): decoder layer k becomes
  an instance of a subclass whose forward first copies its input into a static buffer of the
  layer (`omni_thinker::capture_rows`, a custom op that declares the mutation), so torch.compile
  keeps the copy and CUDA graphs replay it; the rows are read after the forward.

Only opted-in requests (`SamplingParams.extra_args[REQUEST_KEY]`) are copied to the host, once per
position: a request recomputed after preemption resends nothing it sent already (the high-water
mark per request lives until vLLM reports the request finished or aborted). The states leave the
worker at once (ZMQ PUSH to the stage process); the worker holds nothing between steps.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .settings import REQUEST_KEY, ChunkHeader, EngineSettings, step_frames

logger = logging.getLogger("vllm_omni_plugin.thinker_states")

# ZMQ messages queued toward a stage that stopped reading before the worker's send blocks (the
# stage reads on its own thread and never stops while it lives; this only bounds a dead stage).
SEND_HWM = 64


def _platform_worker() -> type:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        return CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


CAPTURE_BUFFER = "omni_thinker_capture"


@torch.library.custom_op("omni_thinker::capture_rows", mutates_args=("out",))
def capture_rows(out: torch.Tensor, value: torch.Tensor) -> None:
    """out[:n] = value (n rows). An op of its own so that torch.compile keeps the write to the
    layer's buffer and a CUDA graph replays it."""
    out[: value.shape[0]].copy_(value)


@capture_rows.register_fake
def _(out: torch.Tensor, value: torch.Tensor) -> None:
    return None


_CAPTURING_CLASSES: dict[type, type] = {}


def capturing_layer_class(base: type) -> type:
    """`base` (a decoder layer class, forward(positions, hidden_states, residual)) whose forward
    first writes its input, the residual stream (hidden + residual), to its capture buffer."""
    if base not in _CAPTURING_CLASSES:

        def forward(self, positions, hidden_states, residual, *args, **kwargs):
            value = hidden_states if residual is None else hidden_states + residual
            torch.ops.omni_thinker.capture_rows(getattr(self, CAPTURE_BUFFER), value)
            return base.forward(self, positions, hidden_states, residual, *args, **kwargs)

        _CAPTURING_CLASSES[base] = type(f"Capturing{base.__name__}", (base,), {"forward": forward})
    return _CAPTURING_CLASSES[base]


class ThinkerStatesRunnerMixin:
    """Added in front of vLLM's V1 model runner class (GPUModelRunner or its CPU subclass)."""

    _omni_states: _Extraction | None = None

    def load_model(self, *args, **kwargs):
        out = super().load_model(*args, **kwargs)
        settings = EngineSettings.from_additional_config(self.vllm_config.additional_config)
        if settings is not None:
            self._omni_states = _Extraction(self, settings)
        return out

    def execute_model(self, scheduler_output, *args, **kwargs):
        ext = self._omni_states
        if ext is None:
            return super().execute_model(scheduler_output, *args, **kwargs)
        ext.begin_step(scheduler_output)
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)
        finally:
            ext.end_step()

    def _model_forward(self, *args, **kwargs):
        ext = self._omni_states
        # None: a dummy or profiling run, extraction off, or nothing of this step to send.
        if ext is None or ext.plan() is None:
            return super()._model_forward(*args, **kwargs)
        ext.before_forward(kwargs)
        out = super()._model_forward(*args, **kwargs)
        ext.after_forward(out)
        return out


_RUNNER_CLASSES: dict[type, type] = {}


def runner_class_for(base: type) -> type:
    if base not in _RUNNER_CLASSES:
        _RUNNER_CLASSES[base] = type(
            f"ThinkerStates{base.__name__}", (ThinkerStatesRunnerMixin, base), {}
        )
    return _RUNNER_CLASSES[base]


class ThinkerStatesWorker(_platform_worker()):
    """vLLM's worker for this platform, with the extracting model runner."""

    def init_device(self):
        super().init_device()
        if getattr(self, "use_v2_model_runner", False):
            raise RuntimeError(
                "thinker hidden states need vLLM's V1 model runner: the stage sets "
                "VLLM_USE_V2_MODEL_RUNNER=0 for its engine; something turned V2 back on"
            )
        runner = self.model_runner
        # The runner is built by vLLM's own init_device; it becomes an instance of our subclass
        # (which adds methods only, no state of its own at construction), so vLLM's runner
        # construction runs once and unchanged.
        runner.__class__ = runner_class_for(type(runner))


class _Step:
    """One step's plan: for each opted-in request, its rows in the flattened batch to send."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.chunks: list[ChunkHeader] = []
        self.captured: dict[int, torch.Tensor] = {}


class _Extraction:
    def __init__(self, runner, settings: EngineSettings):
        self.runner = runner
        self.layers = tuple(sorted(set(settings.layers)))
        self.endpoint = settings.endpoint
        self.capture = settings.capture
        self.step: _Step | None = None
        self.pending: tuple[Any, dict[str, int]] | None = None  # (scheduler output, starts)
        self.sent_upto: dict[str, int] = {}  # request id -> first position not yet sent
        self.keys: dict[str, str] = {}  # request id -> the stage's key
        self.buffers: dict[int, torch.Tensor] = {}  # layer -> its capture buffer (older vLLM)
        self.aux = False
        self.socket = None
        from vllm.distributed import get_tensor_model_parallel_rank

        self.sender = get_tensor_model_parallel_rank() == 0
        self._check_config(runner.vllm_config)
        self._setup_capture(runner.get_model())

    # ---- setup ---------------------------------------------------------------------------
    @staticmethod
    def _check_config(cfg) -> None:
        if cfg.speculative_config is not None:
            raise ValueError("thinker hidden states: speculative decoding is not supported")
        if cfg.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("thinker hidden states: pipeline parallelism is not supported")

    def _decoder(self, model):
        lm = model.get_language_model() if hasattr(model, "get_language_model") else model
        return getattr(lm, "model", lm)

    def _setup_capture(self, model) -> None:
        deep = [k for k in self.layers if k > 0]
        decoder = self._decoder(model)
        num_layers = len(decoder.layers)
        if any(k < 0 or k >= num_layers for k in self.layers):
            raise ValueError(
                f"thinker hidden states: layers {self.layers} outside 0..{num_layers - 1}"
            )
        if not deep:
            return
        from vllm.model_executor.models.interfaces import supports_eagle3

        aux = supports_eagle3(model) and hasattr(decoder, "_maybe_add_hidden_state")
        if aux and self.capture == "auto":
            model.set_aux_hidden_state_layers(tuple(deep))
            # vLLM's runner unpacks (hidden, aux) in every forward, dummy runs included, only
            # when this flag is up; nothing else reads it without a speculative config.
            self.runner.use_aux_hidden_state_outputs = True
            self.aux = True
            return
        rows = self.runner.max_num_tokens  # the most a forward runs, CUDA graph padding included
        for k in deep:
            layer = decoder.layers[k]
            width = layer.input_layernorm.weight.shape[0]
            dtype = self.runner.model_config.dtype
            buffer = torch.zeros(rows, width, dtype=dtype, device=self.runner.device)
            layer.register_buffer(CAPTURE_BUFFER, buffer, persistent=False)
            layer.__class__ = capturing_layer_class(type(layer))
            self.buffers[k] = buffer

    # ---- per step --------------------------------------------------------------------------
    def begin_step(self, so) -> None:
        for rid in so.finished_req_ids:  # finished or aborted: forget it
            self.sent_upto.pop(rid, None)
            self.keys.pop(rid, None)
        starts: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            starts[new.req_id] = new.num_computed_tokens
            extra = getattr(new.sampling_params, "extra_args", None) or {}
            if extra.get(REQUEST_KEY) is not None:
                self.keys[new.req_id] = str(extra[REQUEST_KEY])
        cached = so.scheduled_cached_reqs
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            starts[rid] = computed
        self.pending = (so, starts) if self.keys else None

    def plan(self) -> _Step | None:
        """The rows of this step to send, in the flattened batch: the order of the runner's
        input batch, read here because vLLM adds, removes and reorders requests in
        `execute_model` before the forward."""
        if self.pending is None:
            return None
        so, starts = self.pending
        self.pending = None
        if not self.sender:
            return None  # the other tensor-parallel ranks hold the same states: one sends
        step = _Step()
        offset = 0
        for rid in self.runner.input_batch.req_ids:
            n = so.num_scheduled_tokens.get(rid, 0)
            key = self.keys.get(rid)
            if key is not None and n:
                start = starts[rid]
                first = max(start, self.sent_upto.get(rid, 0))  # a recompute resends nothing
                if first < start + n:
                    step.rows.extend(range(offset + first - start, offset + n))
                    step.chunks.append(ChunkHeader(key, first, start + n - first))
                    self.sent_upto[rid] = start + n
            offset += n
        self.step = step if step.rows else None
        return self.step

    def end_step(self) -> None:
        self.step = None
        self.pending = None

    def _select(self, t: torch.Tensor, step: _Step) -> torch.Tensor:
        index = torch.tensor(step.rows, device=t.device)
        return t.index_select(0, index).to("cpu", non_blocking=False)

    def before_forward(self, kwargs: dict) -> None:
        if 0 not in self.layers:
            return
        step = self.step
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            embeds = self.runner.get_model().embed_input_ids(kwargs["input_ids"])
        step.captured[0] = self._select(embeds, step)

    def after_forward(self, out) -> None:
        step = self.step
        if self.aux:
            _, aux = out
            for k, t in zip([k for k in self.layers if k > 0], aux, strict=True):
                step.captured[k] = self._select(t, step)
        for k, buffer in self.buffers.items():
            step.captured[k] = self._select(buffer, step)
        self._send(step)

    # ---- out of the process ------------------------------------------------------------------
    def _send(self, step: _Step) -> None:
        frames = step_frames(self.layers, step.chunks, [step.captured[k] for k in self.layers])
        self._socket().send_multipart(frames, copy=False)

    def _socket(self):
        if self.socket is None:
            import zmq

            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoint)
            self.socket = sock
        return self.socket
