"""The code predictor's sampling with its noise drawn before the predictor runs.

vLLM samples as an exponential race: the code is `argmax(probs / q)` with `q ~ Exp(1)` per id,
which draws exactly from `probs`. Drawing every `q` of a frame (all sub-steps) up front leaves
the predictor's 15 sub-steps free of random-number calls and of per-row branches: static shapes
and no host synchronisation, so one CUDA graph can hold the whole frame (predictor_graphs.py),
and eager runs give the same codes from the same noise.

- `PredictorDraws.fill` draws the noise: rows with a seeded generator from their generator (one
  draw for the whole frame, so a seed fixes whole frames), the others from the global one.
- `sample_codes` applies the predictor's settings (families.qwen3_omni.PREDICTOR_SAMPLING:
  temperature, then top-k, then top-p over what top-k kept, as vLLM's sampler orders them)
  on the most likely ids in order and races the noise; greedy rows take the argmax of the
  logits. Only the top `candidate_count` ids are ordered (one top-k select instead of a sort
  of the whole codebook, and noise for those ranks alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_omni_plugin.families.qwen3_omni import PREDICTOR_SAMPLING

# `q` of exactly 0 (a uniform draw of 0) would make `0 / 0` a NaN, which argmax picks.
_MIN_NOISE = 1e-20
# top-k keeps every id at least as likely as the k-th, ties included (as vLLM's and
# transformers' top-k do): the ids ordered are the k most likely and this many more, room for
# the ties bf16 logits make at the k-th value.
TIE_SLACK = 14


def candidate_count(vocab_size: int) -> int:
    """How many of the most likely ids a sub-step orders and races."""
    return min(vocab_size, int(PREDICTOR_SAMPLING["top_k"]) + TIE_SLACK)


@dataclass
class PredictorDraws:
    """How each row of a batch chooses its codes. `greedy` `[B]` bool (None: every row is
    greedy, and no noise is needed); `generators` row -> its own seeded generator."""

    greedy: torch.Tensor | None
    generators: dict[int, torch.Generator] = field(default_factory=dict)

    def fill(self, noise: torch.Tensor) -> None:
        """Draw `noise` `[B, sub-steps, candidates]` (float32) in place: Exp(1) per entry, each
        seeded row's whole frame from its generator, the other rows from the global one."""
        if len(self.generators) != noise.shape[0]:
            noise.exponential_()
        for row, generator in self.generators.items():
            noise[row].exponential_(generator=generator)


def sample_codes(logits: torch.Tensor, noise: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """One sub-step's codes `[B]` (int64) from its logits `[B, V]` and noise `[B, C]` (one
    entry per rank of the C = candidate_count(V) most likely ids): the argmax where `greedy`,
    else a draw with the predictor's settings."""
    cfg = PREDICTOR_SAMPLING
    scaled = logits.float() / cfg["temperature"]
    ordered, order = scaled.topk(noise.shape[-1], dim=-1)  # most likely first
    k = min(int(cfg["top_k"]), ordered.shape[-1])
    ordered = ordered.masked_fill(ordered < ordered[:, k - 1 : k], float("-inf"))
    # top-p keeps the most likely ids up to and including the one that brings their mass to p.
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    ordered = ordered.masked_fill(before >= cfg["top_p"], float("-inf"))
    # The race runs in rank order: each rank has its own noise entry, i.i.d. like the ids'.
    probs = ordered.softmax(dim=-1)
    rank = (probs / noise.clamp_min(_MIN_NOISE)).argmax(dim=-1, keepdim=True)
    drawn = order.gather(1, rank).squeeze(1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


def predict_with_noise(
    model, hidden: torch.Tensor, code0: torch.Tensor, noise: torch.Tensor, greedy: torch.Tensor
) -> torch.Tensor:
    """Code groups 1.. `[B, G - 1]` of each row's frame (the talker's `predict_residuals`),
    sub-step j choosing with `noise[:, j]`: the function the predictor's graphs hold."""

    def sample(j: int, logits: torch.Tensor) -> torch.Tensor:
        return sample_codes(logits, noise[:, j], greedy)

    return model.predict_residuals(hidden, code0, sample)


def predict_eagerly(
    model, hidden: torch.Tensor, code0: torch.Tensor, draws: PredictorDraws
) -> torch.Tensor:
    """`predict_with_noise` for the rows as they are, noise drawn here; all-greedy batches
    skip the noise and the sampling ops (their codes are the same argmaxes)."""
    if draws.greedy is None:
        return model.predict_residuals(hidden, code0)
    shape = predictor_noise_shape(model, hidden.shape[0])
    noise = torch.empty(shape, dtype=torch.float32, device=hidden.device)
    draws.fill(noise)
    return predict_with_noise(model, hidden, code0, noise, draws.greedy)


def predictor_noise_shape(model, rows: int) -> tuple[int, int, int]:
    """`[rows, sub-steps, candidates]`: the noise one step of `rows` frames needs."""
    heads = model.code_predictor.lm_head
    return rows, len(heads), candidate_count(heads[0].out_features)
