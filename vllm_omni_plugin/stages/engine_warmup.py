"""Step shapes a stage's vLLM engine first meets under load, run once before the stage is ready.

vLLM captures CUDA graphs for decode batches up to its largest capture size and its profile run
compiles the largest prefill; every other step runs eagerly, and Triton compiles a kernel variant
the first time a step needs it: the fused-MoE GEMMs once per config (chosen by the step's token
count) and per whether `tokens x top-k` is a multiple of 16 (Triton specialises integer
arguments on it), the top-k/top-p sampler once per batch layout. A compile takes one to two
seconds and stalls every request in that engine, so without this the first concurrent load pays
them all (vLLM logs "Triton kernel JIT compilation during inference", once per kernel name).

Only on CUDA: elsewhere nothing is compiled per shape. The requests are the stage's own kind
(token ids for an AR stage, embeddings for the talker), sampled as the stage samples, and each
ends after one or two tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# The token counts vLLM's tuned fused-MoE tables are keyed by (a step takes the nearest key's
# config); the default config's buckets (32, 64, 96, 128, 512) are among them.
MOE_CONFIG_KEYS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)
# Concurrent requests in the batched rounds: odd and even, a multiple of 16 and one past it.
WARMUP_BATCHES = (2, 3, 8, 16, 17, 32)
# Prompt length of each request of a batched round.
BATCH_PROMPT = 4

# What of a stage's sampling settings picks the sampler's kernels.
SAMPLER_KEYS = frozenset(
    {
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    }
)

# (length, request id) -> (prompt, SamplingParams): one warm-up request.
RequestFactory = Callable[[int, str], tuple[Any, Any]]


def warmup_lengths(max_step_tokens: int, max_prompt: int) -> list[int]:
    """Prompt lengths whose prefill alone in a step meets every fused-MoE config key within the
    step budget, at the key and one past it (with an even top-k, `tokens x top-k` once a
    multiple of 16 and once not); then the budget itself, the longest prefill step."""
    limit = min(max_step_tokens, max_prompt)
    lengths = {n for key in MOE_CONFIG_KEYS for n in (key, key + 1) if 2 <= n <= limit}
    lengths.add(limit)
    return sorted(lengths)


def sampler_settings(*layers: dict[str, Any]) -> dict[str, Any]:
    """The sampler's settings of `layers` merged, a later layer's over an earlier's (e.g. the
    checkpoint's generation config, then the stage's defaults)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update(layer)
    return {k: v for k, v in merged.items() if k in SAMPLER_KEYS}


def warmup_batches(max_num_seqs: int) -> list[int]:
    return [b for b in WARMUP_BATCHES if b <= max_num_seqs]


async def _run(engine: Any, request: RequestFactory, length: int, request_id: str) -> None:
    prompt, params = request(length, request_id)
    async for _ in engine.generate(prompt, params, request_id):
        pass


async def warm_step_shapes(engine: Any, request: RequestFactory, *, force: bool = False) -> float:
    """Run the warm-up requests on `engine` (an AsyncLLM); seconds taken (0 off CUDA unless
    `force`). Prefills one at a time, so each step holds exactly one prompt; then rounds of
    concurrent short requests, whose decode steps run at each batch size."""
    config = engine.vllm_config
    if config.device_config.device_type != "cuda" and not force:
        return 0.0
    start = time.monotonic()
    sched = config.scheduler_config
    # A prompt leaves room for the tokens it generates within the model's length.
    max_prompt = config.model_config.max_model_len - 2
    lengths = warmup_lengths(sched.max_num_batched_tokens, max_prompt)
    for n in lengths:
        await _run(engine, request, n, f"warmup-prefill-{n}")
    batches = warmup_batches(sched.max_num_seqs)
    for size in batches:
        await asyncio.gather(
            *(_run(engine, request, BATCH_PROMPT, f"warmup-batch-{size}-{i}") for i in range(size))
        )
    took = time.monotonic() - start
    logger.info(
        "warmed %d prefill lengths (%d-%d tokens) and batches %s in %.1f s",
        len(lengths),
        lengths[0],
        lengths[-1],
        batches,
        took,
    )
    return took


def text_prompt(length: int, vocab_size: int) -> dict[str, list[int]]:
    """A token-id prompt of `length` ordinary ids, different for each length (so no prefix-cache
    hit shortens a prefill); ids stay below the tokenizers' special and media ranges."""
    high = min(vocab_size, 100_000)
    low = min(1_000, high // 2)
    span = high - low
    return {
        "prompt_token_ids": [low + (length * 7_919 + i * 104_729) % span for i in range(length)]
    }
