"""The chat stage's messages on the stage socket (common/messages.py): vLLM's EngineCoreRequest,
made by vLLM's own InputProcessor for a real (tiny) model, survives GenerateText's encoding
field for field; a vLLM RequestOutput with logprobs survives TextOutput (stages/ar_text.py ->
serving/text_engine.py) exactly, and vLLM's own `RequestOutput.add` merges two of them as
vLLM's collector would."""

from __future__ import annotations

import pytest

from vllm_omni_plugin.common.messages import (
    GenerateText,
    TextOutput,
    decode_from_stage,
    decode_to_stage,
    encode,
)
from vllm_omni_plugin.serving.text_engine import TextEngine
from vllm_omni_plugin.stages.ar_text import to_text_output


def _request_output(token_ids, text, finished, prompt=True):
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    logprobs = [
        {t: Logprob(logprob=-0.5, rank=1, decoded_token="a"), 7: Logprob(-1.25, 2, "b")}
        for t in token_ids
    ]
    return RequestOutput(
        request_id="r",
        prompt="hi",
        prompt_token_ids=[1, 2, 3] if prompt else None,
        prompt_logprobs=[None, {2: Logprob(-0.1, 1, "x")}, {3: Logprob(-0.2, 3, None)}],
        outputs=[
            CompletionOutput(
                index=0,
                text=text,
                token_ids=token_ids,
                cumulative_logprob=-1.0,
                logprobs=logprobs,
                finish_reason="stop" if finished else None,
                stop_reason=None,
            )
        ],
        finished=finished,
        num_cached_tokens=0,
    )


def test_request_output_round_trip_and_merge():
    out = _request_output([5, 6], "ab", finished=False)
    msg = decode_from_stage(encode(to_text_output("r", out, first=True)))
    assert isinstance(msg, TextOutput)
    back = TextEngine._request_output(msg, "hi", msg.prompt_token_ids)
    c, d = back.outputs[0], out.outputs[0]
    assert (c.text, list(c.token_ids), c.cumulative_logprob, c.finish_reason) == (
        d.text,
        list(d.token_ids),
        d.cumulative_logprob,
        d.finish_reason,
    )
    assert [
        {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in p.items()} for p in c.logprobs
    ] == [{t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in p.items()} for p in d.logprobs]
    assert back.prompt_token_ids == [1, 2, 3] and back.prompt == "hi"
    assert back.prompt_logprobs[0] is None and back.prompt_logprobs[2][3].rank == 3
    later = decode_from_stage(
        encode(to_text_output("r", _request_output([8], "c", True, False), first=False))
    )
    assert later.prompt_token_ids is None  # prompt fields travel once
    back.add(TextEngine._request_output(later, "hi", [1, 2, 3]), aggregate=True)
    assert back.outputs[0].text == "abc" and list(back.outputs[0].token_ids) == [5, 6, 8]
    assert back.finished


@pytest.fixture(scope="module")
def input_processor(tmp_path_factory):
    """vLLM's own VllmConfig, renderer and InputProcessor for the tiny Qwen2 (no engine)."""
    from tiny_text_model import build_tiny_text_model
    from vllm import AsyncEngineArgs
    from vllm.renderers import renderer_from_config
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.input_processor import InputProcessor

    model = build_tiny_text_model(tmp_path_factory.mktemp("tiny-qwen2") / "m")
    config = AsyncEngineArgs(
        model=str(model), dtype="float32", max_model_len=128, enforce_eager=True
    ).create_engine_config(UsageContext.OPENAI_API_SERVER)
    renderer = renderer_from_config(config)
    yield InputProcessor(config, renderer)
    renderer.shutdown()


def test_engine_request_round_trip(input_processor):
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, seed=4)
    request = input_processor.process_inputs(
        "chatcmpl-1",
        {"type": "token", "prompt_token_ids": [10, 11, 12, 13]},
        params,
        supported_tasks=("generate",),
    )
    buffers = [bytes(b) for b in MsgpackEncoder().encode(request)]
    msg = decode_to_stage(encode(GenerateText("chatcmpl-1", buffers, "prompt")))
    assert isinstance(msg, GenerateText) and msg.prompt_text == "prompt"
    back = MsgpackDecoder(EngineCoreRequest).decode(msg.engine_request)
    assert back.request_id == request.request_id
    assert back.prompt_token_ids == [10, 11, 12, 13]
    sp = back.sampling_params
    assert (sp.max_tokens, sp.temperature, sp.logprobs, sp.seed) == (5, 0.0, 2, 4)
