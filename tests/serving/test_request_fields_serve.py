"""Every request field on every route is applied or refused, on real servers
(conftest's session servers: Qwen-Image, GLM-Image, Qwen-Image-Edit, Wan2.2).

The walk sends each field of the union of every family's knobs and of vLLM-Omni's documented
request extensions (plus OpenAI's fields for its own models) to each route of each server, one
at a time on an otherwise valid request, and accepts exactly two outcomes: a 400 whose `param`
names the field, or the field applied, shown by a changed image against the same request
without it (same seed) or by the video job echoing the value it runs with. Nothing is answered
200 and ignored. Applied requests use few steps and tiny sizes; refusals cost no stage work.
"""

from __future__ import annotations

import base64
import io
import json
import time
import zipfile

import av
import httpx
import numpy as np
import pytest
from omni_server import API_KEY
from openai import BadRequestError, OpenAI
from PIL import Image

from vllm_omni_plugin.serving.request_fields import REFUSED, family_catalogue

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
TIMEOUT = 120

# A valid value of each field (the knobs' within their bounds); the walk sends them one by one.
VALUES: dict[str, object] = {
    "true_cfg_scale": 7.0,
    "guidance_scale_2": 9.0,
    "boundary_ratio": 0.5,
    "flow_shift": 8.0,
    "layers": 4,
    "resolution": 640,
    "vae_use_slicing": True,
    "vae_use_tiling": True,
    "generator_device": "cpu",
    "extra_params": {"foo": 1},
    "use_system_prompt": "dynamic",
    "system_prompt": "be brief",
    "sys_type": "en_vanilla",
    "bot_task": "cot",
    "return_stage_metrics": True,
    "strength": 0.5,
    "mask_image": "data:image/png;base64,AAAA",
    "reference_image": "data:image/png;base64,AAAA",
    "image_reference": {"image_url": "https://example.com/a.png"},
    "video_reference": {"video_url": "https://example.com/a.mp4"},
    "audio_reference": {"audio_url": "https://example.com/a.wav"},
    "input_references": "x",
    "video_params": {"width": 32, "height": 32},
    "generate_sound": True,
    "sound_duration": 1.0,
    "enable_frame_interpolation": True,
    "frame_interpolation_exp": 2,
    "frame_interpolation_scale": 0.5,
    "frame_interpolation_model_path": "elfgum/RIFE-4.22.lite",
    "style": "vivid",
    "input_fidelity": "high",
    "remix_video_id": "video_x",
    "quality": "high",
    "moderation": "low",
    "background": "transparent",
}


def walked_fields() -> list[str]:
    knobs = {k.name for fam in family_catalogue().values() for k in fam}
    return sorted(knobs | set(REFUSED) | {"quality", "moderation", "background"})


def test_the_walk_covers_every_knob_and_refused_field():
    assert set(walked_fields()) <= set(VALUES), set(walked_fields()) - set(VALUES)
    assert {"true_cfg_scale", "guidance_scale_2", "boundary_ratio", "flow_shift"} <= set(
        walked_fields()
    )


def announced_knobs(server) -> set[str]:
    stages = httpx.get(f"{server.url}/v1/omni/stages", headers=HEADERS, timeout=30).json()
    return {k["name"] for k in stages["stages"][-1]["info"].get("knobs", [])}  # omitted: none


def png_bytes(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=float)


# ---- images: generations (JSON) and edits (multipart) ---------------------------------------
def source_png(size: int = 64) -> bytes:
    rng = np.random.default_rng(0)
    im = Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
    out = io.BytesIO()
    im.save(out, format="PNG")
    return out.getvalue()


def post_image(server, route: str, fields: dict) -> httpx.Response:
    url = f"{server.url}/v1/images/{route}"
    if route == "generations":
        return httpx.post(url, json=fields, headers=HEADERS, timeout=TIMEOUT)
    form = {k: v if isinstance(v, str) else json.dumps(v) for k, v in fields.items()}
    files = {"image": ("source.png", source_png(), "image/png")}
    return httpx.post(url, data=form, files=files, headers=HEADERS, timeout=TIMEOUT)


def walk_images(server, route: str, base: dict) -> dict[str, str]:
    """Each field on `base`: 'applied' or 'refused'; fails on anything else."""
    knobs = announced_knobs(server)
    if knobs:  # the same request without the knob, to compare against
        baseline = post_image(server, route, base)
        assert baseline.status_code == 200, baseline.text
        reference = png_bytes(baseline.json()["data"][0]["b64_json"])
    outcome = {}
    for name in walked_fields():
        res = post_image(server, route, {**base, name: VALUES[name]})
        if name in knobs:
            assert res.status_code == 200, (name, res.text)
            got = png_bytes(res.json()["data"][0]["b64_json"])
            assert np.abs(got - reference).mean() > 0, f"{name} was accepted but changed nothing"
            outcome[name] = "applied"
        else:
            assert res.status_code == 400, (name, res.status_code, res.text[:300])
            err = res.json()["error"]
            assert err["param"] == name and name in err["message"], (name, err)
            assert err["code"] in ("unknown_parameter", "invalid_value"), (name, err)
            outcome[name] = "refused"
    return outcome


def test_walk_generations_qwen_image(small_qwen_server):
    base = {"prompt": "a red cube", "size": "64x64", "num_inference_steps": 2, "seed": 5}
    out = walk_images(small_qwen_server, "generations", {**base, "negative_prompt": "blurry"})
    assert out["true_cfg_scale"] == "applied"
    assert out["flow_shift"] == out["guidance_scale_2"] == "refused"
    # Refusals say which families take a knob this family lacks.
    res = post_image(small_qwen_server, "generations", {**base, "flow_shift": 3.0})
    assert "Wan2.2" in res.json()["error"]["message"]


def test_walk_generations_glm_image(shared_glm_server):
    base = {"prompt": "a red cube", "size": "32x32", "num_inference_steps": 2, "seed": 5}
    out = walk_images(shared_glm_server, "generations", base)
    assert set(out.values()) == {"refused"}  # GLM-Image has no knob of its own
    # And a common field the family does not apply: GLM-Image has no negative prompt.
    res = post_image(shared_glm_server, "generations", {**base, "negative_prompt": "blurry"})
    assert res.status_code == 400 and res.json()["error"]["param"] == "negative_prompt"


def test_walk_edits_glm_image(shared_glm_server):
    base = {"prompt": "make it red", "size": "32x32", "num_inference_steps": "2", "seed": "5"}
    out = walk_images(shared_glm_server, "edits", base)
    assert set(out.values()) == {"refused"}  # no knob of its own: every one is a 400


def test_walk_edits_qwen_image_edit(shared_edit_server):
    base = {"prompt": "make it red", "num_inference_steps": "2", "seed": "5"}
    out = walk_images(shared_edit_server, "edits", {**base, "negative_prompt": "blurry"})
    assert out["true_cfg_scale"] == "applied"
    assert out["layers"] == out["strength"] == "refused"


# ---- videos: /v1/videos (the job echoes what it runs with) and /v1/videos/sync -------------
VIDEO_BASE = {
    "prompt": "a red cat",
    "size": "32x32",
    "num_frames": 5,
    "num_inference_steps": 2,
    "seed": 3,
    "guidance_scale": 5.0,
}


def wait_job(server, video_id: str) -> dict:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        job = httpx.get(f"{server.url}/v1/videos/{video_id}", headers=HEADERS, timeout=30).json()
        if job["status"] in ("completed", "failed"):
            return job
        time.sleep(0.2)
    raise TimeoutError(video_id)


def test_walk_videos_wan(shared_wan_server):
    server = shared_wan_server
    knobs = announced_knobs(server)
    assert knobs == {"guidance_scale_2", "boundary_ratio", "flow_shift"}
    jobs = {}
    for name in walked_fields():
        body = {**VIDEO_BASE, name: VALUES[name]}
        for path in ("/v1/videos", "/v1/videos/sync"):
            if name in knobs and path.endswith("sync"):
                continue  # applied: one job each is enough (the sync route runs one below)
            res = httpx.post(f"{server.url}{path}", json=body, headers=HEADERS, timeout=TIMEOUT)
            if name in knobs:
                assert res.status_code == 200, (name, res.text)
                job = res.json()
                assert job[name] == VALUES[name], (name, job)  # the value the job runs with
                jobs[name] = job["id"]
            else:
                assert res.status_code == 400, (name, path, res.status_code, res.text[:300])
                err = res.json()["error"]
                assert err["param"] == name and name in err["message"], (name, err)
    for name, video_id in jobs.items():
        job = wait_job(server, video_id)
        assert job["status"] == "completed", (name, job)
        assert job[name] == VALUES[name]


# ---- item 2 and 3 through the official client and httpx ------------------------------------
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT)


def test_true_cfg_scale_through_the_openai_client(small_qwen_server):
    c = client(small_qwen_server)
    kw = {"prompt": "a red cube", "size": "64x64", "model": small_qwen_server.model}
    extra = {"seed": 9, "num_inference_steps": 2, "negative_prompt": "blurry"}
    a = c.images.generate(**kw, extra_body={**extra, "true_cfg_scale": 2.0})
    b = c.images.generate(**kw, extra_body={**extra, "true_cfg_scale": 6.0})
    same = c.images.generate(**kw, extra_body={**extra, "true_cfg_scale": 2.0})
    assert np.abs(png_bytes(a.data[0].b64_json) - png_bytes(b.data[0].b64_json)).mean() > 0
    assert a.data[0].b64_json == same.data[0].b64_json
    for bad, param in (
        ({"true_cfg_scale": 101}, "true_cfg_scale"),
        ({"true_cfg_scale": "x"}, "true_cfg_scale"),
        ({"true_cfg_scale": 3.0, "negative_prompt": None}, "true_cfg_scale"),
        # Not guidance-distilled: diffusers ignores guidance_scale, with or without CFG.
        ({"guidance_scale": 4.0, "negative_prompt": None}, "guidance_scale"),
        ({"guidance_scale": 4.0}, "guidance_scale"),
        ({"lora": {"name": "x"}}, "lora"),
    ):
        body = {k: v for k, v in {**extra, **bad}.items() if v is not None}
        with pytest.raises(BadRequestError) as info:
            c.images.generate(**kw, extra_body=body)
        assert info.value.body["param"] == param, (bad, info.value.body)


def test_response_format_file_and_output_format_spellings(small_qwen_server):
    url = f"{small_qwen_server.url}/v1/images/generations"
    body = {"prompt": "a cube", "size": "64x64", "num_inference_steps": 1, "seed": 1}
    one = httpx.post(
        url,
        json={**body, "response_format": "file", "output_format": "JPG"},
        headers=HEADERS,
        timeout=TIMEOUT,
    )
    assert one.status_code == 200, one.text
    assert one.headers["content-type"] == "image/jpeg"
    assert 'filename="' in one.headers["content-disposition"]
    assert one.headers["content-disposition"].endswith('.jpg"')
    assert Image.open(io.BytesIO(one.content)).format == "JPEG"
    as_json = client(small_qwen_server).images.generate(
        model=small_qwen_server.model,
        prompt="a cube",
        size="64x64",
        output_format="PNG",  # any case
        extra_body={"num_inference_steps": 1, "seed": 1},
    )
    assert as_json.output_format == "png"
    two = httpx.post(
        url, json={**body, "n": 2, "response_format": "file"}, headers=HEADERS, timeout=TIMEOUT
    )
    assert two.status_code == 200 and two.headers["content-type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(two.content)) as zf:
        names = zf.namelist()
        assert names == ["image_0.png", "image_1.png"]
        first = zf.read(names[0])
    single = httpx.post(
        url, json={**body, "response_format": "b64_json"}, headers=HEADERS, timeout=TIMEOUT
    )
    # The zip holds the same image the JSON answer carries for the same seed.
    assert first == base64.b64decode(single.json()["data"][0]["b64_json"])
    stream = httpx.post(
        url, json={**body, "response_format": "file", "stream": True}, headers=HEADERS
    )
    assert stream.status_code == 400 and stream.json()["error"]["param"] == "response_format"


def test_fields_a_request_would_not_read_are_400s(small_qwen_server, shared_edit_server):
    """Through the official client, on both image routes: stream-only fields without a stream,
    `url` with a stream, output_compression with PNG: each a 400 naming it (no stage work)."""
    gen = client(small_qwen_server).images.generate
    kw = {"model": small_qwen_server.model, "prompt": "a cube", "size": "64x64"}
    for more, param in (
        ({"partial_images": 2}, "partial_images"),
        ({"stream": True, "response_format": "url"}, "response_format"),
        ({"output_compression": 50}, "output_compression"),
        ({"extra_body": {"progress_events": True}}, "progress_events"),
    ):
        with pytest.raises(BadRequestError) as info:
            gen(**kw, **more)
        assert (info.value.body["param"], info.value.body["code"]) == (param, "invalid_value")
    with pytest.raises(BadRequestError) as info:
        client(shared_edit_server).images.edit(
            model=shared_edit_server.model,
            image=("s.png", source_png(), "image/png"),
            prompt="make it red",
            output_format="png",
            output_compression=50,
        )
    assert info.value.body["param"] == "output_compression"


def test_edit_true_cfg_scale_through_the_openai_client(shared_edit_server):
    c = client(shared_edit_server)
    extra = {"seed": 4, "num_inference_steps": 2, "negative_prompt": "blurry"}

    def edit(**more):
        body = {k: v for k, v in {**extra, **more}.items() if v is not None}
        res = c.images.edit(
            model=shared_edit_server.model,
            image=("s.png", source_png(), "image/png"),
            prompt="make it red",
            extra_body=body,
        )
        return png_bytes(res.data[0].b64_json)

    assert np.abs(edit(true_cfg_scale=1.5) - edit(true_cfg_scale=8.0)).mean() > 0
    # Not guidance-distilled: diffusers ignores guidance_scale, with or without CFG.
    for more in (
        {"guidance_scale": 4.0, "negative_prompt": None},
        {"guidance_scale": 4.0},
        {"true_cfg_scale": 1.5, "guidance_scale": 2.0},
    ):
        with pytest.raises(BadRequestError) as info:
            edit(**more)
        assert info.value.body["param"] == "guidance_scale", more
        assert info.value.body["code"] == "invalid_value", more


def test_edit_source_as_data_url_equals_the_upload(shared_edit_server):
    url = f"{shared_edit_server.url}/v1/images/edits"
    form = {"prompt": "make it red", "num_inference_steps": "2", "seed": "4"}
    uploaded = httpx.post(
        url,
        data=form,
        files={"image": ("s.png", source_png(), "image/png")},
        headers=HEADERS,
        timeout=TIMEOUT,
    )
    assert uploaded.status_code == 200, uploaded.text
    data_url = "data:image/png;base64," + base64.b64encode(source_png()).decode()
    # Text parts only (no file): multipart as vLLM-Omni's clients send it.
    by_url = httpx.post(
        url,
        files=[(k, (None, v)) for k, v in {**form, "url": data_url}.items()],
        headers=HEADERS,
        timeout=TIMEOUT,
    )
    assert by_url.status_code == 200, by_url.text
    assert by_url.json()["data"][0]["b64_json"] == uploaded.json()["data"][0]["b64_json"]
    remote = httpx.post(
        url,
        files=[(k, (None, v)) for k, v in {**form, "url": "http://127.0.0.1:1/a.png"}.items()],
        headers=HEADERS,
        timeout=TIMEOUT,
    )
    assert remote.status_code == 400, remote.text
    assert remote.json()["error"]["param"] == "url"
    assert "edit_url_hosts" in remote.json()["error"]["message"]


def test_videos_width_height_and_sync(shared_wan_server):
    server = shared_wan_server
    c = client(server)
    # width/height instead of size, through the official client's extra_body.
    job = c.videos.create(
        prompt="a cat",
        extra_body={"width": 48, "height": 32, "num_frames": 5, "num_inference_steps": 2},
    )
    assert job.size == "48x32"
    for extra, param in (
        ({"size": "32x32", "width": 48, "height": 32}, "size"),
        ({"width": 48}, "height"),
        ({"seconds": "3", "num_frames": 5, "fps": 16}, "num_frames"),
        ({"width": 50, "height": 32}, "width"),
    ):
        with pytest.raises(BadRequestError) as info:
            c.videos.create(prompt="a cat", extra_body=extra)
        assert info.value.body["param"] == param, (extra, info.value.body)
    assert wait_job(server, job.id)["status"] == "completed"

    t0 = time.monotonic()
    res = httpx.post(
        f"{server.url}/v1/videos/sync",
        json={**VIDEO_BASE, "flow_shift": 8.0},
        headers=HEADERS,
        timeout=TIMEOUT,
    )
    wall = time.monotonic() - t0
    assert res.status_code == 200, res.text
    assert res.headers["content-type"] == "video/mp4"
    assert 0 < float(res.headers["x-inference-time-s"]) <= wall
    with av.open(io.BytesIO(res.content)) as container:
        assert sum(1 for _ in container.decode(video=0)) == VIDEO_BASE["num_frames"]
    # It ran as a job in the same queue: listed, with the value it ran with, and its content
    # is the bytes the sync answer carried.
    video_id = res.headers["x-request-id"]
    listed = c.videos.retrieve(video_id)
    assert listed.status == "completed" and listed.model_extra["flow_shift"] == 8.0
    content = httpx.get(
        f"{server.url}/v1/videos/{video_id}/content", headers=HEADERS, timeout=TIMEOUT
    )
    assert content.content == res.content


def test_openapi_bodies_come_from_the_table(small_qwen_server):
    spec = httpx.get(f"{small_qwen_server.url}/openapi.json", timeout=30).json()

    def props(path: str, content_type: str) -> dict:
        body = spec["paths"][path]["post"]["requestBody"]["content"][content_type]
        return body["schema"]["properties"]

    gen = props("/v1/images/generations", "application/json")
    assert "true_cfg_scale" in gen and "Qwen-Image" in gen["true_cfg_scale"]["description"]
    assert "lora" in gen and "flow_shift" in gen  # lora: a route-wide extension
    assert "url" in props("/v1/images/edits", "multipart/form-data")
    for path in ("/v1/videos", "/v1/videos/sync"):
        video = props(path, "application/json")
        assert {"width", "height", "guidance_scale_2", "boundary_ratio"} <= set(video)
