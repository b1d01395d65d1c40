"""The thinker's hidden states out of vLLM's engine (models/thinker_states): a real vLLM engine on
the tiny Qwen3-Omni checkpoint (one start for the module), greedy, against transformers' thinker
run over the same tokens (`output_hidden_states`): `hidden_states[0]` (the input embeddings, media
merged in) and `hidden_states[accept_hidden_layer]`, for every prompt position (media included)
and every generated token that had a forward (all but the last sampled one).

Video is not covered: transformers' Qwen3-Omni video processor needs torchvision, which the CPU
environment lacks (the tiny deploy file sets `limit_mm_per_prompt: {video: 0}`).
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
import torch

from vllm_omni_plugin.models import thinker_states as ts

# fp32 on both sides; vLLM's CPU kernels (fused norms, MoE, attention) round differently from
# transformers' eager ops: max |vLLM - transformers| / max |transformers|, per layer.
REL_TOL = 1e-4
# Batched against alone: the same kernels on other batch shapes.
BATCH_REL_TOL = 1e-5
# Chunked prefill: a text prompt longer than a step's token budget arrives in several steps.
MAX_BATCHED_TOKENS = 64


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def accept_layer(omni_dir) -> int:
    return json.loads((omni_dir / "config.json").read_text())["talker_config"][
        "accept_hidden_layer"
    ]


@pytest.fixture(scope="module")
def processor(omni_dir):
    from transformers import AutoProcessor

    from vllm_omni_plugin.entry_points import patches

    # transformers' Qwen3-Omni processor and vLLM's thinker without torchvision need patch 7
    # (entry_points/patches.py), which stage pipelines install (vLLM's processes inherit it).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(patches.STAGE_PIPELINE_ENV, "1")
        patches.install_torchvision_free_qwen2_vl()
        yield AutoProcessor.from_pretrained(omni_dir)


@pytest.fixture(scope="module")
def engine(omni_dir, processor):
    """(event loop, AsyncLLM, store) for the module; the engine starts once (~30 s)."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kwargs = dict(
        model=str(omni_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        max_num_seqs=4,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        limit_mm_per_prompt={"video": 0},
        additional_config={ts.ADDITIONAL_CONFIG_KEY: {}},
    )
    store = ts.attach(kwargs)
    assert kwargs["enable_prefix_caching"] is False
    loop = asyncio.new_event_loop()
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    yield loop, llm, store
    llm.shutdown()
    store.close()
    loop.close()


async def _generate(llm, store, prompt, key, max_tokens=6):
    from vllm import SamplingParams

    params = ts.opt_in(SamplingParams(max_tokens=max_tokens, temperature=0), key)
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


def test_text_prompt_in_chunks_equals_transformers(engine, omni_model, processor, accept_layer):
    """A prompt three times a step's token budget: chunked prefill, then decode steps."""
    text = chat_prompt(processor, [{"type": "text", "text": "count with me " * 40}])
    inputs = processor(text=[text], return_tensors="pt")
    assert inputs["input_ids"].shape[1] > 2 * MAX_BATCHED_TOKENS
    ids, prompt_len, layers, chunks = extract(engine, {"prompt": text}, "text")
    assert ids[:prompt_len] == inputs["input_ids"][0].tolist()
    # One chunk per step: the prompt in ceil(L / budget) steps, then one per generated token.
    assert len(chunks) == -(-prompt_len // MAX_BATCHED_TOKENS) + len(ids) - prompt_len - 1
    want = transformers_states(omni_model, inputs, ids, (0, accept_layer, accept_layer - 1))
    check(layers, want, accept_layer, prompt_len, ids)
    # The comparison tells layers apart: the neighbouring layer is far outside the tolerance.
    assert rel_err(layers[accept_layer], want[accept_layer - 1]) > 100 * REL_TOL


def _image():
    from PIL import Image

    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), "RGB")


def _tone():
    return (0.3 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)).astype(np.float32)


def test_image_prompt_equals_transformers(engine, omni_model, processor, accept_layer):
    image = _image()
    text = chat_prompt(processor, [{"type": "image"}, {"type": "text", "text": "What is it?"}])
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    prompt = {"prompt": text, "multi_modal_data": {"image": image}}
    ids, prompt_len, layers, _ = extract(engine, prompt, "image")
    assert ids[:prompt_len] == inputs["input_ids"][0].tolist()
    image_token = omni_model.config.thinker_config.image_token_id
    assert ids.count(image_token) > 1  # the media positions are in the comparison
    want = transformers_states(omni_model, inputs, ids, (0, accept_layer))
    check(layers, want, accept_layer, prompt_len, ids)


def test_audio_prompt_equals_transformers(engine, omni_model, processor, accept_layer):
    tone = _tone()
    text = chat_prompt(processor, [{"type": "audio"}, {"type": "text", "text": "What is it?"}])
    inputs = processor(text=[text], audio=[tone], return_tensors="pt")
    prompt = {"prompt": text, "multi_modal_data": {"audio": (tone, 16000)}}
    ids, prompt_len, layers, _ = extract(engine, prompt, "audio")
    assert ids[:prompt_len] == inputs["input_ids"][0].tolist()
    audio_token = omni_model.config.thinker_config.audio_token_id
    assert ids.count(audio_token) > 1
    want = transformers_states(omni_model, inputs, ids, (0, accept_layer))
    check(layers, want, accept_layer, prompt_len, ids)


def test_video_prompt():
    pytest.skip(
        "video: transformers' Qwen3-Omni video processor needs torchvision, absent from the "
        "CPU environment (the tiny deploy file sets limit_mm_per_prompt: {video: 0})"
    )


def test_two_requests_batched_equal_each_alone(engine, processor):
    loop, llm, store = engine
    text = chat_prompt(processor, [{"type": "text", "text": "Say something."}])
    image = _image()
    image_text = chat_prompt(processor, [{"type": "image"}, {"type": "text", "text": "Hm?"}])
    prompts = {
        "b-text": {"prompt": text},
        "b-image": {"prompt": image_text, "multi_modal_data": {"image": image}},
    }
    alone = {key: extract(engine, p, key + "-alone") for key, p in prompts.items()}

    async def both():
        return await asyncio.gather(
            *(_generate(llm, store, p, key, max_tokens=6) for key, p in prompts.items())
        )

    results = loop.run_until_complete(both())
    for (key, _), (ids, _) in zip(prompts.items(), results, strict=True):
        got = store.collect(key)
        store.release(key)
        a_ids, _, a_layers, _ = alone[key]
        assert ids == a_ids
        assert got.start == 0
        for k, t in a_layers.items():
            assert rel_err(got.layers[k], t) <= BATCH_REL_TOL, (key, k)
    assert store.held_bytes == 0 and store.keys() == []


def test_aborted_request_leaves_nothing_held(engine, processor):
    from vllm import SamplingParams

    loop, llm, store = engine
    text = chat_prompt(processor, [{"type": "text", "text": "Go on."}])
    params = ts.opt_in(SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True), "ab")
    store.open("ab")

    async def run_then_abort():
        agen = llm.generate({"prompt": text}, params, "ab")
        async for out in agen:
            if len(out.outputs[0].token_ids) >= 5:
                break
        await agen.aclose()  # AsyncLLM aborts the request in the engine
        await asyncio.sleep(0.5)  # steps already in flight deliver their states

    loop.run_until_complete(run_then_abort())
    assert store.held("ab") > 0  # states arrived, not consumed
    store.release("ab")
    assert store.held_bytes == 0 and store.keys() == []
    # The engine no longer runs it, and anything still in flight for it is dropped.
    time.sleep(0.5)
    assert store.held_bytes == 0
    assert llm.output_processor.get_num_unfinished_requests() == 0
