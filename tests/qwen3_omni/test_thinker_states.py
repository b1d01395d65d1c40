"""The thinker's hidden states out of vLLM's engine (models/thinker_states): a real vLLM engine on
the tiny Qwen3-Omni checkpoint (one start for the module), greedy, against transformers' thinker
run over the same tokens (`output_hidden_states`): `hidden_states[0]` (the input embeddings, media
merged in) and `hidden_states[accept_hidden_layer]`, for every prompt position (media included)
and every generated token that had a forward (all but the last sampled one).

Video runs through the torch-only Qwen2-VL video processor where torchvision is absent
(models/qwen3_omni/video_processor.py), on both sides of the comparison.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from vllm_omni_plugin.models import thinker_states as ts

from .thinker_states_common import (
    BATCH_REL_TOL,
    REL_TOL,
    _generate,
    accept_layer_of,
    chat_prompt,
    check,
    collect_engine,
    extract,
    processor_for,
    random_image,
    random_video,
    rel_err,
    start_engine,
    transformers_states,
)

MAX_BATCHED_TOKENS = 64


@pytest.fixture(scope="module")
def accept_layer(omni_dir) -> int:
    return accept_layer_of(omni_dir)


@pytest.fixture(scope="module")
def processor(omni_dir):
    with processor_for(omni_dir) as p:
        yield p


@pytest.fixture(scope="module")
def engine(omni_dir, processor):
    """(event loop, AsyncLLM, store) for the module; the engine starts once (~30 s)."""
    with start_engine(omni_dir, max_num_batched_tokens=MAX_BATCHED_TOKENS) as started:
        yield started
    del started
    collect_engine()


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


def test_a_repeated_image_prompt_reads_no_prefix_cache(engine, omni_model, processor, accept_layer):
    """The engine caches prefixes; the same image prompt extracted twice (its second prefill
    would be served from the cache, running no forward for its cached blocks) gives every
    prompt position's states both times, each equal to transformers'."""
    image = random_image()
    text = chat_prompt(processor, [{"type": "image"}, {"type": "text", "text": "And this?"}])
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    prompt = {"prompt": text, "multi_modal_data": {"image": image}}
    want = None
    for key in ("first", "again"):
        ids, prompt_len, layers, _ = extract(engine, prompt, f"repeat-{key}")
        assert ids[:prompt_len] == inputs["input_ids"][0].tolist()
        if want is None:
            want = transformers_states(omni_model, inputs, ids, (0, accept_layer))
        check(layers, want, accept_layer, prompt_len, ids)


def _tone():
    return (0.3 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)).astype(np.float32)


def test_image_prompt_equals_transformers(engine, omni_model, processor, accept_layer):
    image = random_image()
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


def test_video_prompt_equals_transformers(engine, omni_model, processor, accept_layer):
    """Four frames: vLLM's thinker (its video path, the processor of the checkpoint's name)
    against transformers' thinker on the processor's outputs for the same frames."""
    video = random_video()
    text = chat_prompt(processor, [{"type": "video"}, {"type": "text", "text": "What happens?"}])
    inputs = processor(text=[text], videos=[video], return_tensors="pt")
    prompt = {"prompt": text, "multi_modal_data": {"video": video}}
    ids, prompt_len, layers, _ = extract(engine, prompt, "video")
    assert ids[:prompt_len] == inputs["input_ids"][0].tolist()
    video_token = omni_model.config.thinker_config.video_token_id
    assert ids.count(video_token) > 1
    want = transformers_states(omni_model, inputs, ids, (0, accept_layer))
    check(layers, want, accept_layer, prompt_len, ids)


def test_two_requests_batched_equal_each_alone(engine, processor):
    loop, llm, store = engine
    text = chat_prompt(processor, [{"type": "text", "text": "Say something."}])
    image = random_image()
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


def test_warm_up_runs_every_step_shape_on_the_engine(engine):
    """stages/engine_warmup.py on this engine (forced: it runs on CUDA only): each prefill
    length within the step budget and each batch the sequence limit allows, sampled with
    top-k/top-p, and every request finishes."""
    from vllm import SamplingParams

    from vllm_omni_plugin.stages.engine_warmup import (
        BATCH_PROMPT,
        text_prompt,
        warm_step_shapes,
        warmup_batches,
        warmup_lengths,
    )

    loop, llm, _ = engine
    vocab = llm.model_config.get_vocab_size()
    prompt_lengths: list[int] = []

    def request(length, request_id):
        prompt = text_prompt(length, vocab)
        prompt_lengths.append(len(prompt["prompt_token_ids"]))
        return prompt, SamplingParams(max_tokens=2, temperature=0.7, top_k=20, top_p=0.8)

    assert loop.run_until_complete(warm_step_shapes(llm, request)) == 0.0  # not on CUDA
    assert prompt_lengths == []
    took = loop.run_until_complete(warm_step_shapes(llm, request, force=True))
    sched = llm.vllm_config.scheduler_config
    lengths = warmup_lengths(sched.max_num_batched_tokens, llm.model_config.max_model_len - 2)
    assert lengths[-1] == MAX_BATCHED_TOKENS
    batches = warmup_batches(sched.max_num_seqs)
    assert prompt_lengths == lengths + [BATCH_PROMPT] * sum(batches)
    assert took > 0
    assert llm.output_processor.get_num_unfinished_requests() == 0
