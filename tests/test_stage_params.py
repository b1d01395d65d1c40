"""What a stage's Submit carries of a request (common/messages.stage_params): the talker only
its speech fields, Code2Wav nothing; the AR and diffusion kinds the whole GenerationParams. Each
crosses a stage's socket and the node link as its own typed struct."""

from __future__ import annotations

import msgspec
import pytest

from vllm_omni_plugin.common.link_messages import ToStage, decode_link
from vllm_omni_plugin.common.messages import (
    ChatPrompt,
    Code2WavParams,
    GenerationParams,
    Submit,
    TalkerParams,
    decode_to_stage,
    encode,
    stage_params,
)

SPEECH = GenerationParams(
    "Say hi",
    seed=5,
    chat_request=[b"\x91\x01", b"media" * 1000],
    chat_prompt=ChatPrompt([1, 2, 3], [(2, 4, 6, 0.5)]),
    voice="ethan",
    speech_sampling={"temperature": 0, "seed": 7},
    input_images=[b"png"],
)


def test_the_talker_gets_its_speech_fields_only():
    """Of the chat request only its prompt ids and visual grids: the processed media (here the
    second buffer) go to the chat stage alone."""
    params = stage_params("talker", SPEECH)
    prompt = ChatPrompt([1, 2, 3], [(2, 4, 6, 0.5)])
    assert params == TalkerParams(prompt, "ethan", {"temperature": 0, "seed": 7})
    assert set(msgspec.structs.asdict(params)) == {"chat_prompt", "voice", "speech_sampling"}
    assert len(encode(Submit("r", params))) < 1000 < 5000 < len(encode(Submit("r", SPEECH)))


def test_code2wav_gets_nothing_of_the_request():
    assert stage_params("code2wav", SPEECH) == Code2WavParams()
    assert msgspec.structs.asdict(Code2WavParams()) == {}


@pytest.mark.parametrize("kind", ["ar", "diffusion"])
def test_ar_and_diffusion_stages_get_the_whole_request(kind):
    assert stage_params(kind, SPEECH) is SPEECH


@pytest.mark.parametrize("kind", ["ar", "talker", "code2wav"])
def test_each_payload_crosses_the_socket_and_the_node_link_as_its_type(kind):
    params = stage_params(kind, SPEECH)
    back = decode_to_stage(encode(Submit("r", params))).params
    assert type(back) is type(params) and back == params
    linked = decode_link(encode(ToStage(2, Submit("r", params)))).msg.params
    assert type(linked) is type(params) and linked == params
