"""The thinker's hidden states under preemption, captured by the decoder layers' capture
buffers (what vLLM 0.26-0.28 runs, where the thinker has no auxiliary hidden-state outputs), with
the thinker compiled (torch.compile traces the buffers' custom op; CUDA graphs replay what it
traced). A second engine with a KV cache of 256 tokens, which two requests of ~160 tokens each
(~80 prompt, 80 generated) overflow, so vLLM preempts one and recomputes it from its first
position. Each request's states still equal transformers', with every position sent once (the
worker skips what it sent before the preemption).
"""

from __future__ import annotations

import asyncio

import pytest
from vllm.config import CompilationMode

from vllm_omni_plugin.models.thinker_states.settings import ADDITIONAL_CONFIG_KEY

from .thinker_states_common import (
    _generate,
    accept_layer_of,
    chat_prompt,
    check,
    collect_engine,
    processor_for,
    random_image,
    start_engine,
    transformers_states,
)

BLOCK = 32
BLOCKS = 8  # 256 tokens of KV cache in all (vLLM keeps one more block aside, its null block)


@pytest.fixture(scope="module")
def processor(omni_dir):
    with processor_for(omni_dir) as p:
        yield p


@pytest.fixture(scope="module")
def engine(omni_dir, processor):
    with start_engine(
        omni_dir,
        max_model_len=BLOCK * BLOCKS,
        block_size=BLOCK,
        num_gpu_blocks_override=BLOCKS + 1,
        thinker_states={"capture": "buffer"},
        enforce_eager=False,
    ) as started:
        _, llm, _ = started
        assert llm.vllm_config.additional_config[ADDITIONAL_CONFIG_KEY]["capture"] == "buffer"
        assert llm.vllm_config.compilation_config.mode != CompilationMode.NONE
        yield started
    del started
    collect_engine()


def preemptions() -> float:
    from vllm.v1.metrics.reader import get_metrics_snapshot

    return sum(m.value for m in get_metrics_snapshot() if m.name == "vllm:num_preemptions")


def test_preempted_requests_send_each_position_once(engine, omni_model, processor, omni_dir):
    loop, llm, store = engine
    accept = accept_layer_of(omni_dir)
    image = random_image()
    text = chat_prompt(processor, [{"type": "text", "text": "count with me " * 5}])
    image_text = chat_prompt(
        processor, [{"type": "image"}, {"type": "text", "text": "count with me " * 5}]
    )
    prompts = {
        "p-text": ({"prompt": text}, processor(text=[text], return_tensors="pt")),
        "p-image": (
            {"prompt": image_text, "multi_modal_data": {"image": image}},
            processor(text=[image_text], images=[image], return_tensors="pt"),
        ),
    }
    before = preemptions()

    async def both():
        return await asyncio.gather(
            *(
                _generate(llm, store, p, key, max_tokens=80, ignore_eos=True)
                for key, (p, _) in prompts.items()
            )
        )

    results = loop.run_until_complete(both())
    assert preemptions() > before, "the KV cache was meant to force a preemption"
    for (key, (_, inputs)), (ids, prompt_len) in zip(prompts.items(), results, strict=True):
        assert ids[:prompt_len] == inputs["input_ids"][0].tolist()
        got = store.collect(key)
        store.release(key)
        assert got.start == 0
        want = transformers_states(omni_model, inputs, ids, (0, accept))
        check(got.layers, want, accept, prompt_len, ids)
    assert store.repeated_positions == 0
    assert store.held_bytes == 0
