"""Shared by the thinker-states engine tests: the engine, the reference, the comparisons."""

from __future__ import annotations

import asyncio
import contextlib
import json

import numpy as np
import pytest
import torch

from vllm_omni_plugin.models import thinker_states as ts

# fp32 on both sides; vLLM's CPU kernels (fused norms, MoE, attention) round differently from
# transformers' eager ops: max |vLLM - transformers| / max |transformers|, per layer.
REL_TOL = 1e-4
# Batched against alone: the same kernels on other batch shapes.
BATCH_REL_TOL = 1e-5


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def accept_layer_of(omni_dir) -> int:
    return json.loads((omni_dir / "config.json").read_text())["talker_config"][
        "accept_hidden_layer"
    ]


@contextlib.contextmanager
def processor_for(omni_dir):
    from transformers import AutoProcessor
    from vllm_omni_plugin.entry_points import patches

    # transformers' Qwen3-Omni processor and vLLM's thinker without torchvision need patch 7
    # (entry_points/patches.py), which stage pipelines install (vLLM's processes inherit it);
    # the engine fixtures take the processor fixture, so the patch is in place when vLLM starts.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(patches.STAGE_PIPELINE_ENV, "1")
        patches.install_torchvision_free_qwen2_vl()
        yield AutoProcessor.from_pretrained(omni_dir)


@contextlib.contextmanager
def start_engine(omni_dir, **overrides):
    """(event loop, AsyncLLM, store): vLLM's engine on the tiny checkpoint as the tiny deploy
    file runs its thinker, the extraction attached as the AR stage attaches it."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    states = overrides.pop("thinker_states", {})
    kwargs = dict(
        model=str(omni_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        max_num_seqs=4,
        limit_mm_per_prompt={"video": 1},
        # On, as vLLM's default: an extracted request skips reading it (ts.opt_in).
        enable_prefix_caching=True,
        additional_config={ts.ADDITIONAL_CONFIG_KEY: states},
    )
    kwargs.update(overrides)
    store = ts.attach(kwargs)
    loop = asyncio.new_event_loop()
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    try:
        yield loop, llm, store
    finally:
        llm.shutdown()  # cancels its output handler task: let the loop finish it before closing
        loop.run_until_complete(asyncio.sleep(0.1))
        store.close()
        loop.close()
        del llm


def collect_engine() -> None:
    """Run the finished engine's finalizers now. Left to a later garbage collection, AsyncLLM's
    `__del__` can run inside another test's `ast.parse`, which CPython 3.11 then fails with
    "AST constructor recursion depth mismatch" (seen with tests/test_layering.py)."""
    import gc

    gc.collect()


async def _generate(llm, store, prompt, key, max_tokens=6, **sampling):
    from vllm import SamplingParams

    params = ts.opt_in(SamplingParams(max_tokens=max_tokens, temperature=0, **sampling), key)
    store.open(key)
    final = None
    async for out in llm.generate(prompt, params, key):
        final = out
    ids = list(final.prompt_token_ids) + list(final.outputs[0].token_ids)
    # The last sampled token never goes through the model: no states for it.
    store.finish(key, len(ids) - 1)
    return ids, len(final.prompt_token_ids)


def extract(engine, prompt, key, max_tokens=6):
    loop, llm, store = engine
    ids, prompt_len = loop.run_until_complete(_generate(llm, store, prompt, key, max_tokens))
    chunks = []
    while (got := store.take(key, timeout=30)) is not None:
        assert got, "thinker states stopped arriving"
        chunks.extend(got)
    store.release(key)
    assert store.held_bytes == 0
    starts = [c.start for c in chunks]
    assert starts == sorted(starts)
    layers = {k: torch.cat([c.layers[k] for c in chunks]) for k in chunks[0].layers}
    return ids, prompt_len, layers, chunks


@torch.no_grad()
def transformers_states(model, inputs: dict, ids: list[int], layers) -> dict[int, torch.Tensor]:
    """transformers' thinker over prompt + generated[:-1] in one forward (causal: the same
    states as its incremental generate), `hidden_states[k]` for each k."""
    seq = torch.tensor([ids[:-1]])
    media = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    out = model.thinker(
        input_ids=seq, attention_mask=torch.ones_like(seq), output_hidden_states=True, **media
    )
    return {k: out.hidden_states[k][0] for k in layers}


def chat_prompt(processor, parts: list[dict]) -> str:
    return processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )


def check(layers, want, accept_layer, prompt_len, ids):
    n = len(ids) - 1
    assert set(layers) == {0, accept_layer}
    for k in (0, accept_layer):
        assert layers[k].shape == want[k].shape == (n, want[k].shape[-1])
        err = rel_err(layers[k], want[k])
        assert err <= REL_TOL, (k, err)
        # Prompt and generated positions each match (not only the largest values).
        assert rel_err(layers[k][:prompt_len], want[k][:prompt_len]) <= REL_TOL
        assert rel_err(layers[k][prompt_len:], want[k][prompt_len:]) <= REL_TOL


def random_video(frames: int = 4, size: int = 56) -> np.ndarray:
    """(frames, size, size, 3) uint8 frames, as vLLM's video loaders give them."""
    rng = np.random.default_rng(1)
    return rng.integers(0, 256, (frames, size, size, 3), dtype=np.uint8)


def random_image():
    from PIL import Image

    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), "RGB")
