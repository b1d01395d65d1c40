"""A vLLM v1 logits processor that keeps GLM-Image's AR output a valid image grid.

The GLM-Image pipeline's AR stage builds its engine with it (`logits_processors=[LOGITS_PROCESSOR]`,
from the topology's StageSpec); offline users pass the same argument to `vllm.LLM`. It is not an
entry point: vLLM 0.26-0.30 turn off model runner V2 in every engine once any package registers
one. In an engine it is inert unless a request asks for it or the engine serves GLM-Image:

* Per request, `SamplingParams.extra_args["omni_image_grid"] = {"num_tokens": N, "num_codes": C,
  "eos_token_id": E}` (what `t2i_sampling_overrides` returns): output tokens 0..N-1 may only be
  image codes (ids < C), token N may only be E. Random weights sample out-of-range ids and early
  EOS; the DiT would crash on either. Over vLLM's own HTTP API (`vllm serve` of the AR model with
  `--logits-processors`), whose `vllm_xargs` carry no nested objects, the same spec is the list
  `[N, C, E]`.
* Engine-wide, for a `glm_image` model: the two generation_config.json fields transformers'
  `generate` honours and vLLM ignores, so greedy vLLM equals greedy transformers on the same
  checkpoint: single-token `sequence_bias`, and `forced_eos_token_id` at the last allowed token
  (output index max_tokens - 1), except for requests with `ignore_eos=True`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm import SamplingParams
from vllm.logger import init_logger
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from vllm_omni_plugin.families.glm_image.processing import GRID_EXTRA_ARG

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Under "vllm." so vLLM's own log handler prints it in worker processes.
logger = init_logger("vllm.omni_plugin.glm_image")


@dataclass
class _Rule:
    output_ids: Sequence[int]  # live reference to the request's output tokens
    codes_until: int  # output index before which only ids < num_codes are allowed
    num_codes: int
    eos_from: int  # output index from which only eos_id is allowed
    eos_id: int


def _grid_spec(params: SamplingParams) -> dict | None:
    extra = params.extra_args or {}
    spec = extra.get(GRID_EXTRA_ARG)
    if isinstance(spec, (list, tuple)):  # vllm_xargs' form: [num_tokens, num_codes, eos]
        if len(spec) != 3:
            raise ValueError(
                f"extra_args[{GRID_EXTRA_ARG!r}] as a list is [num_tokens, num_codes, "
                f"eos_token_id]; got {spec!r}"
            )
        return dict(zip(("num_tokens", "num_codes", "eos_token_id"), spec, strict=True))
    return spec


class ImageGridLogitsProcessor(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        spec = _grid_spec(sampling_params)
        if spec is None:
            return
        try:
            n, c, e = int(spec["num_tokens"]), int(spec["num_codes"]), int(spec["eos_token_id"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"extra_args[{GRID_EXTRA_ARG!r}] needs integer num_tokens, num_codes, "
                f"eos_token_id; got {spec!r}"
            ) from exc
        if n < 1 or c < 1 or e < 0:
            raise ValueError(f"extra_args[{GRID_EXTRA_ARG!r}] out of range: {spec!r}")
        max_tokens = sampling_params.max_tokens
        if max_tokens is not None and max_tokens < n:
            raise ValueError(f"max_tokens={max_tokens} is below the image grid's {n} tokens")

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.device = device
        self.pin_memory = is_pin_memory
        self.rules: dict[int, _Rule] = {}
        # The masks for the last classification of rows (see apply), kept on the device.
        self._masks_key: tuple | None = None
        self._masks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.bias_ids: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None
        self.forced_eos: int | None = None
        model_config = getattr(vllm_config, "model_config", None)
        hf_config = getattr(model_config, "hf_config", None)
        if getattr(hf_config, "model_type", None) == "glm_image":
            self._load_generation_config(model_config)

    def _load_generation_config(self, model_config) -> None:
        try:
            from transformers import GenerationConfig

            gen = GenerationConfig.from_pretrained(
                model_config.model, revision=model_config.revision
            )
        except Exception:  # no generation_config.json: nothing to honour
            return
        self.forced_eos = gen.forced_eos_token_id
        if isinstance(self.forced_eos, list):
            self.forced_eos = self.forced_eos[0] if self.forced_eos else None
        bias = gen.sequence_bias or []
        pairs = bias.items() if isinstance(bias, dict) else bias
        single = [(int(seq[0]), float(v)) for seq, v in pairs if len(seq) == 1]
        if len(single) != len(list(pairs)):
            logger.warning("GLM-Image: multi-token sequence_bias entries are ignored")
        if single:
            self.bias_ids = torch.tensor([i for i, _ in single], device=self.device)
            self.bias_values = torch.tensor([v for _, v in single], device=self.device)

    def is_argmax_invariant(self) -> bool:
        # It bans and forces tokens: greedy results change.
        return False

    def _new_rule(
        self, params: SamplingParams, _prompt: list[int] | None, output_ids: list[int]
    ) -> _Rule | None:
        spec = _grid_spec(params)
        if spec is not None:
            n = int(spec["num_tokens"])
            return _Rule(output_ids, n, int(spec["num_codes"]), n, int(spec["eos_token_id"]))
        # A request that ignores EOS asked for exactly max_tokens free tokens: forcing EOS as
        # the last one would break that (transformers' generate has no ignore_eos to honour).
        if self.forced_eos is not None and params.max_tokens is not None and not params.ignore_eos:
            last = params.max_tokens - 1
            return _Rule(output_ids, 0, 0, last, self.forced_eos)
        return None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        # vLLM's contract: apply removed, then added, then moved (indices are batch rows).
        if batch_update is None:
            return
        for row in batch_update.removed:
            self.rules.pop(row, None)
        for row, params, prompt, output_ids in batch_update.added:
            rule = self._new_rule(params, prompt, output_ids)
            if rule is None:
                self.rules.pop(row, None)
            else:
                self.rules[row] = rule
        for a, b, direction in batch_update.moved:
            rule_a, rule_b = self.rules.pop(a, None), self.rules.pop(b, None)
            if rule_a is not None:
                self.rules[b] = rule_a
            if rule_b is not None and direction == MoveDirectionality.SWAP:
                self.rules[a] = rule_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.bias_ids is not None:
            logits[:, self.bias_ids] += self.bias_values.to(logits.dtype)
        if not self.rules:
            return logits
        key = (logits.shape[-1], *self._classify())
        if key != self._masks_key:
            self._masks, self._masks_key = self._build_masks(*key), key
        for rows, banned in self._masks:
            logits[rows] = logits[rows].masked_fill(banned, float("-inf"))
        return logits

    def _classify(self) -> tuple[tuple, tuple]:
        """((row, num_codes) for rows held to image codes, (row, eos id) for rows held to EOS).

        The output list holds every token sampled so far (async scheduling keeps a -1
        placeholder for the one in flight), so its length is the index being sampled now. The
        answer changes only when the batch does or a row crosses a boundary (once per request).
        """
        codes, eos = [], []
        for row, rule in self.rules.items():
            j = len(rule.output_ids)
            if j >= rule.eos_from:
                eos.append((row, rule.eos_id))
            elif j < rule.codes_until:
                codes.append((row, rule.num_codes))
        return tuple(codes), tuple(eos)

    def _build_masks(self, vocab_size: int, codes: tuple, eos: tuple) -> list:
        # Rebuilt only when the classification changes, from pinned memory without blocking:
        # a per-step host-to-device copy from pageable memory would synchronise with the GPU
        # every step and undo the overlap that async scheduling exists for.
        vocab = torch.arange(vocab_size, device=self.device)
        masks = []
        if codes:
            rows, limits = self._upload(codes)
            masks.append((rows, vocab.unsqueeze(0) >= limits.unsqueeze(1)))
        if eos:
            rows, keep = self._upload(eos)
            masks.append((rows, vocab.unsqueeze(0) != keep.unsqueeze(1)))
        return masks

    def _upload(self, pairs: tuple) -> tuple[torch.Tensor, ...]:
        host = torch.tensor(pairs, dtype=torch.long, pin_memory=self.pin_memory)
        return host.to(self.device, non_blocking=True).unbind(1)
