"""The code predictor's sampling from noise drawn beforehand (models/qwen3_omni/
predictor_sampling.py) against vLLM's own top-k/top-p op, on the CPU."""

from __future__ import annotations

import torch

from vllm_omni_plugin.families.qwen3_omni import PREDICTOR_SAMPLING
from vllm_omni_plugin.models.qwen3_omni.predictor_graphs import batch_buckets
from vllm_omni_plugin.models.qwen3_omni.predictor_sampling import (
    PredictorDraws,
    candidate_count,
    sample_codes,
)


def _reference_probs(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's sampler's distribution for the predictor's settings (its PyTorch top-k/top-p)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    rows = logits.shape[0]
    k = torch.full((rows,), PREDICTOR_SAMPLING["top_k"], dtype=torch.long)
    p = torch.full((rows,), PREDICTOR_SAMPLING["top_p"], dtype=torch.float32)
    scaled = logits.float() / PREDICTOR_SAMPLING["temperature"]
    return apply_top_k_top_p_pytorch(scaled.clone(), k, p).softmax(dim=-1)


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * 3


def test_greedy_rows_take_the_argmax_and_sampled_rows_stay_in_top_k_top_p():
    logits = _logits(64, 512, 0)
    greedy = torch.arange(64) % 2 == 0
    noise = torch.empty(64, candidate_count(512))
    noise.exponential_(generator=torch.Generator().manual_seed(1))
    codes = sample_codes(logits, noise, greedy)
    assert torch.equal(codes[greedy], logits.argmax(-1)[greedy])
    allowed = _reference_probs(logits) > 0
    assert allowed[torch.arange(64), codes].all()
    # The sampled rows do not all pick their argmax (the noise decides).
    assert not torch.equal(codes[~greedy], logits.argmax(-1)[~greedy])


def test_draws_follow_vllms_top_k_top_p_distribution():
    """One row's logits raced against 20000 independent noise rows: the frequency of every
    id is within 0.01 of vLLM's probability for it (about 7 standard deviations at the
    largest probability; seeded, so the same every run)."""
    draws, vocab = 20000, 256
    # Rounded to bf16, as the talker's logits are: ties among the most likely ids.
    logits = _logits(1, vocab, 2).bfloat16()
    noise = torch.empty(draws, candidate_count(vocab))
    noise.exponential_(generator=torch.Generator().manual_seed(3))
    codes = sample_codes(logits.expand(draws, -1), noise, torch.zeros(draws, dtype=torch.bool))
    freq = torch.bincount(codes, minlength=vocab).float() / draws
    want = _reference_probs(logits)[0]
    assert int((want > 0).sum()) > 5  # top-p leaves several ids to choose from
    assert float((freq - want).abs().max()) < 0.01
    assert bool((freq[want == 0] == 0).all())


def _frame_noise(draws: PredictorDraws, rows: int) -> torch.Tensor:
    noise = torch.empty(rows, 15, 64)
    draws.fill(noise)
    return noise


def test_seeded_rows_draw_whole_frames_from_their_generator():
    def seeded(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    greedy = torch.zeros(3, dtype=torch.bool)
    torch.manual_seed(0)
    first = _frame_noise(PredictorDraws(greedy, {0: seeded(7), 2: seeded(9)}), 3)
    torch.manual_seed(1)  # another global state: only the unseeded row changes
    again = _frame_noise(PredictorDraws(greedy, {0: seeded(7), 2: seeded(9)}), 3)
    assert torch.equal(first[0], again[0]) and torch.equal(first[2], again[2])
    assert not torch.equal(first[1], again[1])
    # The seeded row's frame is its generator's first draw, whatever its row and batch.
    alone = _frame_noise(PredictorDraws(greedy[:1], {0: seeded(7)}), 1)
    assert torch.equal(alone[0], first[0])
    other = _frame_noise(PredictorDraws(greedy, {0: seeded(8), 2: seeded(9)}), 3)
    assert not torch.equal(other[0], first[0])
    assert (first > 0).all()


def test_seeded_noise_fixes_the_codes_and_another_seed_changes_them():
    logits = _logits(1, 512, 4).expand(15, -1)
    greedy = torch.zeros(1, dtype=torch.bool)

    def frame(seed: int) -> torch.Tensor:
        noise = torch.empty(1, 15, candidate_count(512))
        PredictorDraws(greedy, {0: torch.Generator().manual_seed(seed)}).fill(noise)
        return torch.cat([sample_codes(logits[j : j + 1], noise[:, j], greedy) for j in range(15)])

    assert torch.equal(frame(7), frame(7))
    assert not torch.equal(frame(7), frame(8))


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
