"""The chat stage's front end in the API server (serving/text_engine.py) keeps vLLM's
multimodal processor cache in its processor-only form: a repeated video is processed once, and
each engine request still carries the processed item in full, so a stage engine core that
restarted (and holds nothing) can serve it."""

from __future__ import annotations

import asyncio
import base64
import io
from types import SimpleNamespace

import numpy as np

from tests.qwen3_omni.thinker_states_common import processor_for


def _mp4() -> bytes:
    """Four frames of 64 x 64 moving gradients at 2 frames per second, MPEG-4 in MP4."""
    import av

    ys, xs = np.mgrid[0:64, 0:64]
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=2)
        stream.width = stream.height = 64
        stream.pix_fmt = "yuv420p"
        for k in range(4):
            rgb = np.stack([(xs + 8 * k) % 256, (ys + 4 * k) % 256, (xs + ys) % 256], -1)
            frame = av.VideoFrame.from_ndarray(rgb.astype(np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()


def _video_chat() -> list[dict]:
    url = "data:video/mp4;base64," + base64.b64encode(_mp4()).decode()
    part = {"type": "video_url", "video_url": {"url": url}}
    return [{"role": "user", "content": [part, {"type": "text", "text": "What moves?"}]}]


def test_a_repeated_video_is_processed_once_and_sent_in_full(omni_dir):
    from vllm import SamplingParams
    from vllm.renderers import ChatParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder

    from vllm_omni_plugin.config.resolve import load_deploy_config
    from vllm_omni_plugin.serving.text_engine import TextEngine

    cfg = load_deploy_config("qwen3_omni_tiny", model=str(omni_dir), platform="cpu")
    with processor_for(omni_dir):  # the tiny thinker's processor without torchvision
        engine = TextEngine(SimpleNamespace(cfg=cfg), 0)
        try:
            cache = engine.renderer.mm_processor_cache
            decoder = MsgpackDecoder(EngineCoreRequest)
            requests = []
            for i in range(2):
                _, (prompt,) = asyncio.run(
                    engine.renderer.render_chat_async([_video_chat()], ChatParams())
                )
                frames = engine.encode_request(prompt, SamplingParams(max_tokens=1), f"r{i}")
                requests.append(decoder.decode(frames))
            hits, total = cache.make_stats()
        finally:
            engine.shutdown()
    assert (hits, total) == (1, 2)  # the second request's video came from the cache
    first, second = (r.mm_features for r in requests)
    assert len(first) == len(second) == 1
    assert first[0].identifier == second[0].identifier
    # Both carry the processed frames, equal: none is sent by key alone.
    assert first[0].data is not None and second[0].data is not None
    a, b = first[0].data.get_data(), second[0].data.get_data()
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_with_fault_tolerance_the_front_end_keeps_no_cache():
    """vLLM's fault tolerance takes a single API server: the front end then turns its cache off
    rather than build a config vLLM refuses; otherwise the stage's own setting stands."""
    from vllm_omni_plugin.serving.text_engine import FRONT_END_WITHOUT_MIRROR, front_end_args

    stage = {"model": "m", "mm_processor_cache_gb": 2}
    assert front_end_args(stage) == {**stage, "_api_process_count": FRONT_END_WITHOUT_MIRROR}
    tolerant = {**stage, "enable_fault_tolerance": True}
    assert front_end_args(tolerant) == {**tolerant, "mm_processor_cache_gb": 0}
    assert stage == {"model": "m", "mm_processor_cache_gb": 2}  # the stage's own are untouched


def test_the_chat_stage_engine_keeps_no_mirror_of_the_front_end_cache(omni_dir):
    """vLLM's own cache factories on both configs of the tiny thinker: the front end keeps the
    processor-only cache; the stage's engine core, which only ever receives items in full,
    builds no receiver cache (vLLM's default single-server form would build one)."""
    from vllm import AsyncEngineArgs
    from vllm.multimodal.cache import (
        MultiModalProcessorOnlyCache,
        engine_receiver_cache_from_config,
        processor_cache_from_config,
    )

    from vllm_omni_plugin.config.resolve import load_deploy_config
    from vllm_omni_plugin.serving.text_engine import front_end_args
    from vllm_omni_plugin.stages.ar_stage import chat_stage_engine_args

    cfg = load_deploy_config("qwen3_omni_tiny", model=str(omni_dir), platform="cpu")
    stage = cfg.stage(cfg.topology.chat_stage).engine_kwargs()

    def config(kwargs):
        return AsyncEngineArgs(**kwargs).create_engine_config()

    assert engine_receiver_cache_from_config(config(stage)) is not None  # vLLM's default
    front = processor_cache_from_config(config(front_end_args(stage)))
    assert isinstance(front, MultiModalProcessorOnlyCache)
    assert engine_receiver_cache_from_config(config(chat_stage_engine_args(stage))) is None


def test_the_talker_reads_ids_and_grids_and_never_the_media(omni_dir):
    """A speech request's talker gets the chat stage's prompt ids and each visual item's patch
    grid and frame timing, taken from vLLM's processed request in the API server; the processed
    frames (tens of MB for a short clip) cross to the chat stage only."""
    from vllm import SamplingParams
    from vllm.renderers import ChatParams

    from vllm_omni_plugin.common.messages import GenerationParams, Submit, encode, stage_params
    from vllm_omni_plugin.config.resolve import load_deploy_config
    from vllm_omni_plugin.serving.speech import chat_prompt
    from vllm_omni_plugin.serving.text_engine import TextEngine, encode_engine_request

    cfg = load_deploy_config("qwen3_omni_tiny", model=str(omni_dir), platform="cpu")
    with processor_for(omni_dir):
        engine = TextEngine(SimpleNamespace(cfg=cfg), 0)
        try:
            _, (prompt,) = asyncio.run(
                engine.renderer.render_chat_async([_video_chat()], ChatParams())
            )
            request = engine.engine_request(prompt, SamplingParams(max_tokens=1), "r")
        finally:
            engine.shutdown()
    got = chat_prompt(request)
    (video,) = request.mm_features
    data = video.data.get_data()
    assert got.token_ids == list(request.prompt_token_ids)
    t, h, w = data["video_grid_thw"].reshape(-1).tolist()
    seconds = float(data["second_per_grid_ts"].reshape(-1)[0])
    assert got.visual_grids == [(t, h, w, seconds)] and seconds > 0
    params = GenerationParams("", chat_request=encode_engine_request(request), chat_prompt=got)
    to_talker = len(encode(Submit("r", stage_params("talker", params))))
    to_thinker = len(encode(Submit("r", stage_params("ar", params))))
    assert to_talker < 4 * len(got.token_ids) + 1000
    assert to_thinker > data["pixel_values_videos"].numel() * 4
