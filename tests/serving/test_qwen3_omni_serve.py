"""Qwen3-Omni served end to end: `vllm serve DIR --stage-config qwen3_omni_tiny` on the
tiny checkpoint, thinker (vLLM's own model) -> talker -> Code2Wav, every edge streamed, through the
official `openai` client.

Parity, greedy (the thinker at temperature 0, the talker greedy by the server's
--stage-overrides, 64 frames at most):
- the transcript is the text the same server answers for the text-only request, whose token ids
  equal transformers' thinker's;
- the WAV equals transformers' `generate(..., return_audio=True)` within max abs 0.01: the bound of
  chunked Code2Wav decoding (tests/qwen3_omni/test_code2wav_engine.py) plus the WAV's 16-bit
  quantization (3e-5); it is ~0.002 here;
- the streamed pcm16 deltas join to exactly the non-streamed WAV's samples;
- requests decoded together give what each gives alone within 2 LSB of 16-bit audio (6e-5: a
  batched decode sums in another order; tests/qwen3_omni bounds it at 1e-4 in float);
- `input_audio`, `image_url` and `video_url` prompts answer as transformers does, in text and in
  speech (the WAV within the same 0.01), alone or batched with text-only prompts. The video is a
  4-frame MP4 (a data URL) that vLLM decodes; transformers gets the frames vLLM's video loader
  decodes from the same bytes, through the same processor (without torchvision, the torch-only
  Qwen2-VL video processor: models/qwen3_omni/video_processor.py).
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import itertools
import os
import signal
import time
import wave

import httpx
import numpy as np
import openai
import psutil
import pytest
from media_host import MediaHost
from omni_server import API_KEY

from vllm_omni_plugin.testing.qwen3_omni_reference import (
    SAMPLE_RATE,
    chat_input_ids,
    load_reference_model,
    reference_generate,
)

pytestmark = pytest.mark.slow

PROMPT = "Say hi"
THINKER_TOKENS = 8
MAX_FRAMES = 64  # qwen3_omni_tiny.yaml: the talker's default_sampling_params.max_tokens
SPEECH = {"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}}


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def chat(server, prompt: str = PROMPT, **kw):
    kw.setdefault("max_tokens", THINKER_TOKENS)
    return client(server).chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": prompt}], temperature=0, **kw
    )


def wav_samples(b64: str) -> np.ndarray:
    with wave.open(io.BytesIO(base64.b64decode(b64))) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SAMPLE_RATE, 1, 2)
        return np.frombuffer(w.readframes(w.getnframes()), np.int16)


def speak(server, prompt: str = PROMPT) -> tuple[str, np.ndarray]:
    audio = chat(server, prompt, **SPEECH).choices[0].message.audio
    assert audio.id and audio.expires_at > time.time()
    return audio.transcript, wav_samples(audio.data)


@pytest.fixture(scope="module")
def reference(omni_speech_server):
    model = load_reference_model(omni_speech_server.model)
    ids = chat_input_ids(omni_speech_server.model, PROMPT)
    return reference_generate(
        model, ids, thinker_max_new_tokens=THINKER_TOKENS, max_frames=MAX_FRAMES
    )


def test_speech_equals_transformers_wav_within_0_01(omni_speech_server, reference):
    text = chat(omni_speech_server, extra_body={"return_token_ids": True}).choices[0]
    assert text.token_ids == reference.text_ids  # the thinker: vLLM's model, greedy
    transcript, samples = speak(omni_speech_server)
    assert transcript == text.message.content
    assert len(samples) == len(reference.waveform) > 20 * 1920  # the talker's frames: all of them
    diff = np.abs(samples / 32768.0 - reference.waveform)
    assert diff.max() <= 0.01, diff.max()


def test_streamed_audio_starts_before_the_text_ends_and_equals_the_wav(omni_speech_server):
    """pcm16 deltas: several, the first before the last transcript delta, joined equal to the
    non-streamed WAV. The order holds however fast the thinker is (the tiny one writes its 32
    tokens in tens of milliseconds on a CPU, before the talker's first 4 frames): the transcript
    is paced to the audio (speech_source.py), so text past what the audio sent so far covers
    waits for it."""
    kw = {"max_tokens": 32, "extra_body": {"ignore_eos": True}}
    events: list[tuple[str, bytes | str]] = []
    stream = chat(
        omni_speech_server,
        stream=True,
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"},
        **kw,
    )
    for chunk in stream:
        if not chunk.choices:
            continue
        audio = getattr(chunk.choices[0].delta, "audio", None)
        if audio is None:
            continue
        audio = audio if isinstance(audio, dict) else audio.model_dump()
        if audio.get("transcript"):
            events.append(("text", audio["transcript"]))
        if audio.get("data"):
            events.append(("audio", base64.b64decode(audio["data"])))
    kinds = [k for k, _ in events]
    assert kinds.count("audio") >= 3, kinds
    last_text = len(kinds) - 1 - kinds[::-1].index("text")
    assert kinds.index("audio") < last_text, kinds
    streamed = np.frombuffer(b"".join(v for k, v in events if k == "audio"), np.int16)
    transcript = "".join(v for k, v in events if k == "text")
    full = chat(omni_speech_server, **SPEECH, **kw).choices[0].message.audio
    assert transcript == full.transcript
    np.testing.assert_array_equal(streamed, wav_samples(full.data))


def test_requests_together_give_what_each_gives_alone(omni_speech_server):
    prompts = ["Say hi", "Count to three", "What is blue?"]
    alone = [speak(omni_speech_server, p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda p: speak(omni_speech_server, p), prompts))
    for (t1, a1), (t2, a2) in zip(alone, together, strict=True):
        assert t1 == t2 and a1.shape == a2.shape
        assert np.abs(a1.astype(np.int32) - a2).max() <= 2


def test_the_thinker_stage_default_sampling_params_apply(omni_speech_server):
    """qwen3_omni_tiny.yaml sets stage 0's max_tokens default to 32: a request without one
    (EOS ignored) writes exactly 32 tokens, one with its own writes that many, and one asking
    for more gets 32 (vLLM's max_new_tokens override is also a cap, as in stock `vllm serve`)."""
    ignore = {"extra_body": {"ignore_eos": True}}
    answer = chat(omni_speech_server, max_tokens=openai.NOT_GIVEN, **ignore)
    assert answer.usage.completion_tokens == 32
    assert chat(omni_speech_server, max_tokens=5, **ignore).usage.completion_tokens == 5
    assert chat(omni_speech_server, max_tokens=100, **ignore).usage.completion_tokens == 32


MEDIA_QUESTION = "What is this?"


def _tone() -> np.ndarray:
    """1 s of 440 Hz at 16 kHz."""
    return (0.3 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)).astype(np.float32)


def _image():
    """64 x 64 random pixels (4 merged patches for the tiny thinker's vision tower)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), "RGB")


def _mp4() -> bytes:
    """Four frames of 64 x 64 random pixels at 2 frames per second (2 s), MPEG-4 in MP4."""
    import av

    rng = np.random.default_rng(1)
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=2)
        stream.width = stream.height = 64
        stream.pix_fmt = "yuv420p"
        for frame in rng.integers(0, 256, (4, 64, 64, 3), dtype=np.uint8):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return out.getvalue()


def _decoded_video() -> np.ndarray:
    """The frames vLLM's video loader decodes from `_mp4()` (what the served thinker sees)."""
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.media.video import VideoMediaIO

    loaded = VideoMediaIO(ImageMediaIO()).load_bytes(_mp4())
    frames, _ = getattr(loaded, "media", loaded)
    assert frames.shape == (4, 64, 64, 3), frames.shape
    return frames


def media_content(kind: str) -> list[dict]:
    """A question and one `input_audio`, `image_url` (PNG) or `video_url` (MP4) data URL part."""
    from vllm_omni_plugin.serving.audio_encode import encode_audio

    if kind == "audio":
        data = base64.b64encode(encode_audio(_tone(), 16000, "wav")).decode()
        part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    elif kind == "video":
        url = "data:video/mp4;base64," + base64.b64encode(_mp4()).decode()
        part = {"type": "video_url", "video_url": {"url": url}}
    else:
        png = io.BytesIO()
        _image().save(png, "PNG")
        url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        part = {"type": "image_url", "image_url": {"url": url}}
    return [{"type": "text", "text": MEDIA_QUESTION}, part]


def chat_content(server, content: list[dict], **kw):
    kw.setdefault("max_tokens", THINKER_TOKENS)
    return client(server).chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": content}], temperature=0, **kw
    )


@pytest.fixture(scope="module")
def media_references(omni_speech_server):
    """kind -> (prompt ids, transformers' greedy generate end to end: thinker, talker,
    Code2Wav) for the same prompt through transformers' processor."""
    from transformers import AutoProcessor
    from vllm_omni_plugin.entry_points import patches

    # transformers' Qwen3-Omni processor here, as in the server: without torchvision it needs
    # patch 7 (entry_points/patches.py), which stage pipelines install.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(patches.STAGE_PIPELINE_ENV, "1")
        patches.install_torchvision_free_qwen2_vl()
        processor = AutoProcessor.from_pretrained(omni_speech_server.model)
        model = load_reference_model(omni_speech_server.model)
        out = {}
        media_of = {
            "audio": {"audio": [_tone()]},
            "image": {"images": [_image()]},
            "video": {"videos": [_decoded_video()]},
        }
        for kind, media in media_of.items():
            parts = [{"type": "text", "text": MEDIA_QUESTION}, {"type": kind}]
            prompt = processor.apply_chat_template(
                [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
            )
            inputs = processor(text=[prompt], return_tensors="pt", **media)
            ids = inputs.pop("input_ids")
            out[kind] = (
                ids,
                reference_generate(
                    model,
                    ids,
                    thinker_max_new_tokens=THINKER_TOKENS,
                    max_frames=MAX_FRAMES,
                    **inputs,
                ),
            )
    return out


@pytest.mark.parametrize("kind", ["audio", "image", "video"])
def test_media_input_answers_equal_transformers(omni_speech_server, media_references, kind):
    """An `input_audio`, `image_url` or `video_url` part beside text, through vLLM's own chat
    and media processing:
    - in text: transformers' thinker's greedy ids (exactly) for the same processor output;
    - in speech: the same transcript, and the WAV equals transformers' `generate(...,
      return_audio=True)` within max abs 0.01 (as for text prompts above: chunked Code2Wav plus
      16-bit quantization): the talker read the thinker's hidden states at the media positions
      (vLLM's thinker's, within 1e-4 of transformers': tests/qwen3_omni/test_thinker_states.py)
      and, for the image and the video, ran transformers' 3-D positions.
    """
    ids, reference = media_references[kind]
    content = media_content(kind)
    served = chat_content(omni_speech_server, content, extra_body={"return_token_ids": True})
    assert served.usage.prompt_tokens == ids.shape[1]
    assert served.choices[0].token_ids == reference.text_ids
    audio = chat_content(omni_speech_server, content, **SPEECH).choices[0].message.audio
    assert audio.transcript == served.choices[0].message.content
    samples = wav_samples(audio.data)
    assert len(samples) == len(reference.waveform) > 1920
    diff = np.abs(samples / 32768.0 - reference.waveform)
    assert diff.max() <= 0.01, diff.max()


def test_media_by_url_answers_as_inline_from_listed_hosts_and_the_media_folder_only(
    omni_speech_server,
):
    """`image_url`, `audio_url` and `video_url` parts naming http URLs on 127.0.0.1 (listed in
    this server's serving.edit_url_hosts), or file: URLs in the chat stage's
    allowed_local_media_path: the same greedy answer, token for token, as the same bytes sent
    inline, and the same speech. The same http URLs through `localhost`, a host not listed, and
    a file outside the folder: a 400 `url_not_allowed` naming the part, for text and speech
    alike, and the media host is never asked."""
    from vllm_omni_plugin.serving.audio_encode import encode_audio

    png = io.BytesIO()
    _image().save(png, "PNG")
    files = {
        "/a.png": png.getvalue(),
        "/a.wav": encode_audio(_tone(), 16000, "wav"),
        "/a.mp4": _mp4(),
    }
    kinds = {"/a.png": "image_url", "/a.wav": "audio_url", "/a.mp4": "video_url"}

    def content(url: str, path: str) -> list[dict]:
        part_type = kinds[path]
        return [
            {"type": "text", "text": MEDIA_QUESTION},
            {"type": part_type, part_type: {"url": url}},
        ]

    def ids(content: list[dict]) -> list[int]:
        answer = chat_content(omni_speech_server, content, extra_body={"return_token_ids": True})
        return answer.choices[0].token_ids

    with MediaHost(files) as host:
        for path, raw in files.items():
            inline = f"data:application/octet-stream;base64,{base64.b64encode(raw).decode()}"
            assert ids(content(f"{host.url}{path}", path)) == ids(content(inline, path)), path
        assert sorted(host.requests) == sorted(files)
        for path, raw in files.items():
            local = omni_speech_server.media_folder / path.lstrip("/")
            local.write_bytes(raw)
            assert ids(content(local.as_uri(), path)) == ids(content(f"{host.url}{path}", path))
        by_url = chat_content(omni_speech_server, content(f"{host.url}/a.png", "/a.png"), **SPEECH)
        inline = chat_content(omni_speech_server, media_content("image"), **SPEECH)
        assert (
            by_url.choices[0].message.audio.transcript == inline.choices[0].message.audio.transcript
        )
        assert np.array_equal(
            wav_samples(by_url.choices[0].message.audio.data),
            wav_samples(inline.choices[0].message.audio.data),
        )
        asked = len(host.requests)
        elsewhere = host.url.replace("127.0.0.1", "localhost") + "/a.png"
        outside = (omni_speech_server.media_folder.parent / "server.log").as_uri()
        for url, kw in itertools.product((elsewhere, outside), ({}, SPEECH)):
            with pytest.raises(openai.BadRequestError) as err:
                chat_content(omni_speech_server, content(url, "/a.png"), **kw)
            assert (err.value.param, err.value.code) == (
                "messages[0].content[1]",
                "url_not_allowed",
            )
        assert len(host.requests) == asked


def test_text_audio_and_image_prompts_together_give_what_each_gives_alone(omni_speech_server):
    """Text-only, audio, image and audio + image prompts spoken at once (batched in each stage)
    give what each gives alone, within 2 LSB of 16-bit audio."""

    def speak_content(content) -> tuple[str, np.ndarray]:
        audio = chat_content(omni_speech_server, content, **SPEECH).choices[0].message.audio
        return audio.transcript, wav_samples(audio.data)

    both = [*media_content("audio"), media_content("image")[1]]
    contents = [[{"type": "text", "text": "Say hi"}], media_content("audio")]
    contents += [media_content("image"), both]
    alone = [speak_content(c) for c in contents]
    with concurrent.futures.ThreadPoolExecutor(len(contents)) as pool:
        together = list(pool.map(speak_content, contents))
    for (t1, a1), (t2, a2) in zip(alone, together, strict=True):
        assert t1 == t2 and a1.shape == a2.shape and len(a1) > 0
        assert np.abs(a1.astype(np.int32) - a2).max() <= 2


def test_bad_speech_requests_are_openai_400s(omni_speech_server):
    for audio, field in (
        ({"voice": "nobody", "format": "wav"}, "voice"),
        ({"voice": "ethan", "format": "aiff"}, "format"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            chat(omni_speech_server, modalities=["text", "audio"], audio=audio)
        assert field in str(err.value.body), err.value.body
    with pytest.raises(openai.BadRequestError):
        chat(omni_speech_server, n=2, **SPEECH)
    # A prompt the talker has no room for (qwen3_omni_tiny: max_model_len 1024, 64 frames):
    # our 400, though the thinker (2048) would take it.
    with pytest.raises(openai.BadRequestError) as err:
        chat(omni_speech_server, "hi " * 400, **SPEECH)
    assert "context_length_exceeded" in str(err.value.body), err.value.body
    # No assistant turn to speak: a 400 here, never a prompt the talker fails on in a step.
    with pytest.raises(openai.BadRequestError) as err:
        chat(omni_speech_server, extra_body={"add_generation_prompt": False}, **SPEECH)
    assert "add_generation_prompt" in str(err.value.body), err.value.body
    # What only a text answer carries is refused with speech, never dropped from it; a
    # modality that is neither text nor audio is refused for a text answer too.
    for kw, param in (
        ({"logprobs": True, **SPEECH}, "logprobs"),
        ({"extra_body": {"return_token_ids": True}, **SPEECH}, "return_token_ids"),
        ({"modalities": ["text", "video"]}, "modalities"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            chat(omni_speech_server, **kw)
        assert err.value.param == param, err.value.body


def test_speech_sampling_seed_reproduces_the_audio(omni_speech_server):
    """The talker sampling per request (`speech_sampling`, over the deploy file's greedy talker):
    the checkpoint's temperature with a seed gives the same WAV twice, another seed another WAV;
    the chat's own `seed` seeds the talker too. The thinker is greedy, so the text is equal."""

    def sampled(**kw) -> tuple[str, np.ndarray]:
        audio = chat(omni_speech_server, **SPEECH, **kw).choices[0].message.audio
        return audio.transcript, wav_samples(audio.data)

    sampling = {"temperature": 0.9, "top_k": 50}
    t1, first = sampled(extra_body={"speech_sampling": {**sampling, "seed": 11}})
    t2, again = sampled(extra_body={"speech_sampling": {**sampling, "seed": 11}})
    t3, other = sampled(extra_body={"speech_sampling": {**sampling, "seed": 12}})
    assert t1 == t2 == t3
    np.testing.assert_array_equal(first, again)
    assert first.shape != other.shape or not np.array_equal(first, other)
    _, by_chat_seed = sampled(seed=11, extra_body={"speech_sampling": sampling})
    np.testing.assert_array_equal(by_chat_seed, first)


def test_bad_speech_sampling_is_an_openai_400(omni_speech_server):
    for sampling, field in (
        ({"top_p": 2}, "speech_sampling.top_p"),
        ({"temperature": -1}, "speech_sampling.temperature"),
        ({"top_k": 1.5}, "speech_sampling.top_k"),
        ({"beam_width": 2}, "speech_sampling.beam_width"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            chat(omni_speech_server, extra_body={"speech_sampling": sampling}, **SPEECH)
        assert err.value.param == field, err.value.body


def _live(server) -> list[dict]:
    r = httpx.get(
        f"{server.url}/v1/omni/stages?live=1", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    return [s["live"] for s in r.json()["stages"]]


def test_stages_and_metrics_name_each_stage_kind(omni_speech_server):
    """The talker and Code2Wav are their own kinds in /v1/omni/stages and in /metrics' labels,
    and each announces the typed settings its engine runs with."""
    r = httpx.get(
        f"{omni_speech_server.url}/v1/omni/stages",
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    stages = r.json()["stages"]
    assert [s["kind"] for s in stages] == ["ar", "talker", "code2wav"]
    assert [s["info"]["kind"] for s in stages] == ["ar", "talker", "code2wav"]
    talker, code2wav = (stages[i]["info"]["effective"] for i in (1, 2))
    assert talker["kind"] == code2wav["kind"] == "engine"
    # qwen3_omni_tiny.yaml's talker, as its vLLM engine took it
    assert (talker["settings"]["max_num_seqs"], talker["settings"]["max_model_len"]) == (4, 1024)
    assert talker["settings"]["enforce_eager"] is True and "block_size" in talker["settings"]
    # the Code2Wav engine's whole config: the deploy file's settings and its fixed chunking
    assert (code2wav["settings"]["device"], code2wav["settings"]["max_batch_size"]) == ("cpu", 4)
    assert code2wav["settings"]["dtype"] == "float32"
    assert code2wav["settings"]["first_chunk_frames"] == 4
    text = httpx.get(f"{omni_speech_server.url}/metrics").text
    for sid, kind in ((0, "ar"), (1, "talker"), (2, "code2wav")):
        labels = f'kind="{kind}",pipeline="qwen3_omni",stage_id="{sid}"'
        assert f"omni_stage_up{{{labels}}} 1.0" in text, kind


def _stage_pid(server, stage_id: int) -> int:
    r = httpx.get(f"{server.url}/v1/omni/stages", headers={"Authorization": f"Bearer {API_KEY}"})
    return next(s["pid"] for s in r.json()["stages"] if s["stage_id"] == stage_id)


def _wait_idle(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = _live(server)
        if not any(s["requests"] for s in live):
            return
        time.sleep(0.2)
    assert not any(s["requests"] for s in live), live


def test_hang_up_mid_stream_frees_every_stage_and_metrics_show_speech(omni_speech_server):
    """A client that leaves, mid-stream or before a whole answer is done, frees every stage and
    leaves no error in the server's log."""
    stream = chat(
        omni_speech_server,
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"},
    )
    next(iter(stream))
    stream.close()
    _wait_idle(omni_speech_server)
    # A whole-answer (not streamed) request whose client leaves before the answer is done:
    # Code2Wav's stage process is paused meanwhile, so the answer cannot be done first however
    # fast the machine (a tiny answer takes well under a second).
    log_at = omni_speech_server.log.stat().st_size
    code2wav = _stage_pid(omni_speech_server, 2)
    os.kill(code2wav, signal.SIGSTOP)
    try:
        with pytest.raises(openai.APITimeoutError):
            chat(
                omni_speech_server,
                max_tokens=400,
                extra_body={"ignore_eos": True},
                modalities=["text", "audio"],
                audio={"voice": "ethan", "format": "wav"},
                timeout=0.5,
            )
    finally:
        os.kill(code2wav, signal.SIGCONT)
    _wait_idle(omni_speech_server)
    with open(omni_speech_server.log, "rb") as f:
        f.seek(log_at)
        after = f.read().decode(errors="replace")
    assert "cancelled: client disconnected" in after
    assert "Traceback" not in after and "never retrieved" not in after, after[-3000:]
    _, samples = speak(omni_speech_server)  # every stage still answers
    assert len(samples) > 0
    text = httpx.get(f"{omni_speech_server.url}/metrics").text
    for name in ("omni_speech_time_to_first_audio_seconds", "omni_speech_real_time_factor"):
        assert f'{name}_count{{pipeline="qwen3_omni"}}' in text, name


def test_speech_benchmark_measures_the_served_pipeline(omni_speech_server, tmp_path):
    """benchmarks/bench_omni_speech.py's measurement (what each GPU run does once its server is
    healthy) against this server, and its report. Every request completes; the first audio comes
    after 0 and before the stream ends; each answer is whole 80 ms frames (1920 samples at
    24 kHz) less the 555 samples Code2Wav's convolutions hold back at the end, at most the
    config's 64 frames; a prompt gets as many alone as in a load of 4
    (greedy); the real-time factor is wall time over the audio received; the thinker wrote
    exactly the tokens asked (32: the tiny config's default caps requests, as vLLM's does); no
    5xx and no stage restart (our /metrics). The tiny talker (67 codec codes) often ends at its
    end-of-speech code before the cap; prompt 1 runs to it: 64 x 1920 samples less the trim.
    With `media="audio"` (the bench's 10 s spoken question) the request completes too."""
    import asyncio
    import sys

    from omni_server import REPO

    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_omni_speech import build_record, measure
    from omni_speech_client import Lengths
    from omni_speech_report import BEGIN, END, table, write_into

    lengths = Lengths(thinker_tokens=32, frames=MAX_FRAMES)
    url, model = omni_speech_server.url, omni_speech_server.model
    data = asyncio.run(measure(url, model, lengths, 1, [1, 4], api_key=API_KEY))
    assert data["warmup_ok"] and data["http_5xx"] == 0 and data["stage_restarts"] == 0
    assert data["text_c1"]["completed"] == 1 and data["text_c1"]["tokens"] == 32
    # None when the whole answer reached the client in one piece (vLLM merges the deltas of a
    # reader that falls behind, as a loaded machine's client does): no span to rate.
    decode = data["text_c1"]["decode_tokens_per_s"]
    assert decode is None or decode > 0
    c1, c4 = data["speech_c1"], data["speech_c4"]
    samples = {**c1["samples_by_prompt"], **c4["samples_by_prompt"]}
    assert set(samples) == {"0", "1", "2", "3"}
    # code2wav/decoder.py holdback_samples: 555 for the published upsample rates (the tiny's)
    assert {-n % 1920 for n in samples.values()} == {555}, samples
    assert samples["1"] == MAX_FRAMES * 1920 - 555 == max(samples.values())  # the cap, exactly
    for level, load in ((1, c1), (4, c4)):
        assert (load["requests"], load["completed"]) == (level, level), load
        frames = [-(-n // 1920) for n in load["samples_by_prompt"].values()]
        assert load["at_cap"] == frames.count(MAX_FRAMES) and max(frames) <= MAX_FRAMES
        assert 0 < load["ttfa_s"] <= load["ttfa_p90_s"] < load["wall_s"]
        shortest = min(load["samples_by_prompt"].values()) / SAMPLE_RATE
        # no answer outlasts the load (the record rounds wall_s to 1 ms and rtf to 1e-4: a short
        # load's ratio moves by more than 1e-3 relative)
        assert 0 < load["rtf"] <= (load["wall_s"] + 5e-4) / shortest + 5e-5
    assert c1["samples_by_prompt"]["0"] == c4["samples_by_prompt"]["0"]
    heard = asyncio.run(measure(url, model, lengths, 1, [1], api_key=API_KEY, media="audio"))
    assert heard["warmup_ok"] and heard["http_5xx"] == 0, heard
    assert (heard["speech_c1"]["requests"], heard["speech_c1"]["completed"]) == (1, 1), heard
    for load in (c1, c4):  # our /metrics: every stage held the load's requests for a while
        assert set(load["stage_request_s"]) == {"0", "1", "2"}, load
        assert all(v > 0 for v in load["stage_request_s"].values()), load
        # ... and each streamed its first chunk within the request's time to first audio
        # (the stages are submitted together, before the API server starts its clock's end)
        first = load["stage_first_output_s"]
        assert set(first) == {"0", "1", "2"}, load
        assert 0 < first["0"] and 0 < first["1"] and 0 < first["2"] < load["ttfa_p90_s"], load
    assert c4["at_cap"] == 1
    # one answer: its rtf is the load's wall over its audio (within the record's rounding: wall_s
    # to 1 ms, audio_s and rtf to 1e-4)
    low = (c1["wall_s"] - 5e-4) / (c1["audio_s"] + 5e-5) - 5e-5
    high = (c1["wall_s"] + 5e-4) / (c1["audio_s"] - 5e-5) + 5e-5
    assert low <= c1["rtf"] <= high, c1

    rows = [build_record("ours", r, "cpu", lengths, 1.0, dict(data, ready_s=3.0)) for r in (0, 1)]
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(f"# x\n{BEGIN}\nNot measured yet.\n{END}\ntail\n")
    write_into(doc, table(rows), BEGIN, END)
    text = doc.read_text()
    ttfa = f"{c1['ttfa_s']:.2f}"  # the same run twice: no spread
    assert f"| time to first audio, c1 (s) | {ttfa} ({ttfa}-{ttfa}, n=2) |" in text, text
    assert "c1 2/2, c4 8/8; 5xx 0; stage restarts 0" in text
    assert "2/10 answers at the frame cap" in text and text.endswith("tail\n")


def test_media_parts_past_the_default_bounds_are_openai_400s(omni_speech_server):
    """The deploy file's media bounds at their defaults (serving.max_media_parts 32,
    max_media_part_bytes 20 MiB), and an image that does not decode: 400s naming the part and
    the setting, for text and speech answers alike, before the thinker sees the request."""

    def refused(parts: list[dict], **kw) -> openai.BadRequestError:
        content = [{"type": "text", "text": "what is this?"}, *parts]
        with pytest.raises(openai.BadRequestError) as err:
            client(omni_speech_server).chat.completions.create(
                model=omni_speech_server.model,
                messages=[{"role": "user", "content": content}],
                max_tokens=THINKER_TOKENS,
                **kw,
            )
        assert err.value.body["type"] == "invalid_request_error", err.value.body
        return err.value

    remote = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    for kw in ({}, SPEECH):
        err = refused([remote] * 33, **kw)
        assert (err.param, err.code) == ("messages[0].content[33]", "too_many_media_parts")
        assert "serving.max_media_parts" in err.message
    big = base64.b64encode(bytes(20 * 1024 * 1024 + 3)).decode()
    err = refused([{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{big}"}}])
    assert (err.param, err.code) == ("messages[0].content[1]", "media_part_too_large")
    assert "serving.max_media_part_bytes" in err.message
    not_png = base64.b64encode(b"not an image" * 10).decode()
    for kw in ({}, SPEECH):
        bad = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{not_png}"}}
        err = refused([bad], **kw)
        assert (err.param, err.code) == ("messages[0].content[1]", "invalid_image")
    # The server still answers a good request afterwards.
    assert chat(omni_speech_server).choices[0].message.content


def test_a_killed_talker_is_forked_again_and_speaks_as_before(omni_speech_server, reference):
    """Last in this module: it restarts a stage. The talker, SIGKILLed with its process group,
    comes back forked from the server's fork server, as at its first start (its environment is
    the one the API server had then, before vLLM's CPU platform set LD_PRELOAD and thread counts
    in the API server), and the answer after equals transformers' as before, within 0.01."""
    talker = _stage_pid(omni_speech_server, 1)
    os.killpg(talker, signal.SIGKILL)
    deadline = time.monotonic() + 120
    restarted = None
    while restarted in (None, talker) or not _healthy(omni_speech_server):
        assert time.monotonic() < deadline, "the talker did not come back within 120 s"
        time.sleep(0.2)
        restarted = _stage_pid(omni_speech_server, 1)
    assert psutil.Process(restarted).parent().name() == "omni-fork-server"
    transcript, samples = speak(omni_speech_server)
    assert transcript
    assert len(samples) == len(reference.waveform)
    diff = np.abs(samples / 32768.0 - reference.waveform)
    assert diff.max() <= 0.01, diff.max()


def _healthy(server) -> bool:
    return httpx.get(f"{server.url}/health").status_code == 200
