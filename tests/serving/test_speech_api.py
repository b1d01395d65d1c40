"""The speech side of /v1/chat/completions without a server: the request checks (400s before any
stage), the audio encoders (decoded back by FFmpeg through PyAV: exact for wav/pcm16/flac,
length and level for the lossy ones) and OpenAI's response shapes, read back through the official
`openai` client's own models."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from vllm_omni_plugin.serving.audio_encode import FORMATS, encode_audio, to_pcm16
from vllm_omni_plugin.serving.errors import APIError
from vllm_omni_plugin.serving.speech_request import (
    check_modalities,
    check_speech_request,
    checkpoint_voices,
)
from vllm_omni_plugin.serving.speech_shapes import DONE, ChunkWriter, completion_body

RATE = 24000
VOICES = {"ethan": "Ethan", "chelsie": "Chelsie"}


def chat_request(**fields):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate(body)


def check(request, speaks=True):
    return check_speech_request(request, speaks=speaks, voices=VOICES, pipeline="qwen3_omni")


def sine(seconds: float, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def wav_b64(seconds: float) -> str:
    return base64.b64encode(encode_audio(sine(seconds, 16000), 16000, "wav")).decode()


def audio_message(data: str) -> list[dict]:
    part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    return [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]


SPEECH = {"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}}


def test_valid_request_resolves_the_checkpoint_spelling_of_the_voice():
    speech = check(chat_request(**SPEECH))
    assert (speech.voice, speech.format, speech.stream) == ("Ethan", "wav", False)
    streamed = {**SPEECH, "audio": {"voice": "Chelsie", "format": "pcm16"}, "stream": True}
    assert check(chat_request(**streamed)).stream


@pytest.mark.parametrize(
    "fields, param, code",
    [
        ({**SPEECH, "audio": {"voice": "alloy", "format": "wav"}}, "audio.voice", None),
        ({**SPEECH, "audio": {"voice": "ethan", "format": "ogg"}}, "audio.format", None),
        ({**SPEECH, "audio": {"voice": "ethan"}}, "audio.format", None),
        ({**SPEECH, "audio": {"voice": "ethan", "format": "wav", "speed": 2}}, "audio.speed", None),
        ({**SPEECH, "stream": True}, "audio.format", None),  # streams are pcm16
        ({**SPEECH, "n": 2}, "n", None),
        # a text answer's extras: refused with speech rather than dropped from its answer
        ({**SPEECH, "logprobs": True, "top_logprobs": 2}, "logprobs", None),
        ({**SPEECH, "prompt_logprobs": 1}, "prompt_logprobs", None),
        ({**SPEECH, "echo": True}, "echo", None),
        ({**SPEECH, "return_token_ids": True}, "return_token_ids", None),
        ({**SPEECH, "return_tokens_as_token_ids": True}, "return_tokens_as_token_ids", None),
        (
            {
                **SPEECH,
                "audio": {"voice": "ethan", "format": "pcm16"},
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
            "stream_options.continuous_usage_stats",
            None,
        ),
        ({"modalities": ["text", "audio"]}, "audio", "missing"),
        ({"audio": {"voice": "ethan", "format": "wav"}}, "modalities", None),
        ({**SPEECH, "modalities": ["text", "image"]}, "modalities", None),
        # no assistant turn for the talker to speak
        ({**SPEECH, "add_generation_prompt": False}, "add_generation_prompt", None),
        (
            {
                **SPEECH,
                "add_generation_prompt": False,  # vLLM requires it off to continue
                "continue_final_message": True,
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "Hel"},
                ],
            },
            "add_generation_prompt",
            None,
        ),
    ],
)
def test_bad_speech_requests_are_400s_naming_the_field(fields, param, code):
    with pytest.raises(APIError) as err:
        check(chat_request(**fields))
    assert err.value.status == 400 and err.value.param == param
    if code is not None:
        assert err.value.code == code
    body = err.value.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error"


def test_modalities_are_text_and_audio_for_text_answers_too():
    assert check_modalities(chat_request()) is None
    assert check_modalities(chat_request(modalities=["text"])) == ["text"]
    for bad in (["text", "video"], "text", [1]):
        with pytest.raises(APIError) as err:
            check_modalities(chat_request(modalities=bad))
        assert (err.value.status, err.value.param) == (400, "modalities")


def test_speech_for_audio_image_and_video_inputs_passes_and_for_embeddings_is_a_400():
    """Audio within the bound, images and videos pass (the talker reads the thinker's hidden
    states at their positions, on 3-D positions for images and videos); speech for a prompt with
    an embedding part is refused, also when the part sits among text, audio and image parts."""
    audio = audio_message(wav_b64(1.0))
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    video = {"type": "video_url", "video_url": {"url": "data:,"}}
    mixed = [{"role": "user", "content": [*audio[0]["content"], image, video]}]
    for messages in (audio, mixed):
        assert check(chat_request(**{**SPEECH, "messages": messages})).voice
    for part in ({"type": "image_embeds", "image_embeds": "AAAA"},):
        content = [{"type": "text", "text": "and this?"}, *mixed[0]["content"], part]
        with pytest.raises(APIError) as err:
            check(chat_request(**{**SPEECH, "messages": [{"role": "user", "content": content}]}))
        assert (err.value.status, err.value.code) == (400, "unsupported_modality")
        assert f"{part['type']} inputs are not supported yet" in err.value.message


def test_speech_of_a_text_only_deployment_is_a_400():
    with pytest.raises(APIError) as err:
        check(chat_request(**SPEECH), speaks=False)
    assert (err.value.status, err.value.code) == (400, "unsupported_modality")


def test_voices_are_the_talker_config_speakers(tmp_path):
    config = {"talker_config": {"speaker_id": {"Ethan": 2302, "chelsie": 2301}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert checkpoint_voices(tmp_path) == {"ethan": "Ethan", "chelsie": "chelsie"}
    assert checkpoint_voices(tmp_path / "missing") == {}


def decode(data: bytes) -> tuple[np.ndarray, int, str]:
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(stream)]
        return np.concatenate(frames), stream.rate, stream.codec_context.name


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "pcm16"])
def test_every_format_decodes_back(fmt):
    """wav and flac: the same 16-bit samples, exactly; mp3, opus, aac: at least the length
    (encoders pad) and an RMS within 30 % of the input's."""
    x = sine(1.0)
    samples, rate, _ = decode(encode_audio(x, RATE, fmt))
    pcm = np.frombuffer(to_pcm16(x), dtype="<i2")
    if fmt in ("wav", "flac"):
        assert rate == RATE
        np.testing.assert_array_equal(samples.astype(np.int16), pcm)
        return
    level = samples.astype(np.float64)
    if level.dtype != np.float32 and np.abs(level).max() > 2:
        level = level / 32768.0
    assert len(samples) >= len(x) * rate / RATE
    rms_in, rms_out = np.sqrt(np.mean(x.astype(np.float64) ** 2)), np.sqrt(np.mean(level**2))
    assert abs(rms_out - rms_in) / rms_in < 0.3


@pytest.mark.parametrize(("seconds", "rate"), [(0.0, RATE), (0.001, 16000), (0.5, RATE)])
def test_wav_is_canonical_16_bit_mono_pcm(seconds, rate):
    """The stdlib reader sees the fields and samples; the header is the canonical 44-byte PCM
    one (players and OpenAI clients that skip 44 bytes read the samples right)."""
    import struct
    import wave

    x = sine(seconds, rate)
    pcm = to_pcm16(x)
    data = encode_audio(x, rate, "wav")
    with wave.open(io.BytesIO(data), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, rate)
        assert w.getcomptype() == "NONE"
        assert w.getnframes() == len(x)
        assert w.readframes(w.getnframes()) == pcm
    riff, size, wave_id, fmt_id, fmt_size = struct.unpack("<4sI4s4sI", data[:20])
    assert (riff, size, wave_id, fmt_id, fmt_size) == (b"RIFF", 36 + len(pcm), b"WAVE", b"fmt ", 16)
    fmt_fields = struct.unpack("<HHIIHH", data[20:36])
    assert fmt_fields == (1, 1, rate, rate * 2, 2, 16)  # PCM, mono, byte rate, align, bits
    assert data[36:44] == b"data" + struct.pack("<I", len(pcm))
    assert data[44:] == pcm


def test_pcm16_is_raw_little_endian_and_clipped():
    pcm = to_pcm16(np.array([0.0, 1.0, -1.0, 2.0, -2.0], dtype=np.float32))
    assert np.frombuffer(pcm, "<i2").tolist() == [0, 32767, -32767, 32767, -32767]


def test_non_streamed_body_reads_as_openai_chat_completion():
    audio = encode_audio(sine(0.2), RATE, "wav")
    body = completion_body(
        request_id="chatcmpl-1",
        model="m",
        created=100,
        audio_id="audio_1",
        audio=audio,
        transcript="hello",
        finish_reason="stop",
        prompt_tokens=7,
        completion_tokens=3,
    )
    parsed = ChatCompletion.model_validate(body)
    message = parsed.choices[0].message
    assert message.content is None and message.audio is not None
    assert (message.audio.id, message.audio.transcript, message.audio.expires_at) == (
        "audio_1",
        "hello",
        100 + 3600,
    )
    assert base64.b64decode(message.audio.data) == audio
    assert parsed.usage.total_tokens == 10


def test_stream_chunks_read_as_openai_chunks():
    writer = ChunkWriter("chatcmpl-2", "m", "audio_2", include_usage=True)
    lines = [
        writer.role(),
        writer.transcript("he"),
        writer.audio(to_pcm16(sine(0.1))),
        writer.transcript("llo"),
        writer.finish("stop"),
        writer.usage(5, 2),
    ]
    chunks = [ChatCompletionChunk.model_validate_json(line[len("data: ") :]) for line in lines]
    assert all(line.endswith("\n\n") and line.startswith("data: ") for line in lines)
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks[1:4]]
    audio = [d.audio for d in deltas]  # the client's ChoiceDeltaAudio
    assert [a.transcript for a in audio] == ["he", None, "llo"]
    assert base64.b64decode(audio[1].data) == to_pcm16(sine(0.1))
    assert {a.id for a in audio} == {"audio_2"}
    assert chunks[4].choices[0].delta.audio.expires_at == writer.created + 3600
    assert chunks[4].choices[0].finish_reason == "stop"
    assert chunks[5].choices == [] and chunks[5].usage.completion_tokens == 2
    assert DONE == "data: [DONE]\n\n"
