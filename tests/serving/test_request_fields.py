"""The request-field table (serving/request_fields.py) and the helpers that need no
server: refusals name the field and the families that take it, video size/length conflicts,
output_format spellings, the file answer, data: URLs and the allow-listed fetch (a real local
HTTP server)."""

from __future__ import annotations

import asyncio
import base64
import io
import zipfile

import pytest
from media_host import MediaHost

from vllm_omni_plugin.common.knobs import CfgFacts, Knob, KnobError, check_knobs
from vllm_omni_plugin.common.limits import RequestLimits
from vllm_omni_plugin.config.owners_common import ServingLimits
from vllm_omni_plugin.serving import request_fields as rf
from vllm_omni_plugin.serving.edit_urls import decode_data_url, fetch_url
from vllm_omni_plugin.serving.errors import APIError
from vllm_omni_plugin.serving.handlers import file_answer
from vllm_omni_plugin.serving.protocol import ImageLimits
from vllm_omni_plugin.serving.validation import validate_request
from vllm_omni_plugin.serving.videos_request import VideoBounds, check_video_request

STAGE = RequestLimits(16, 16, 16, 256, 256, 50, 4, 32, 32)
# As the Qwen-Image and Wan2.2 stages announce them (their adapters' knobs and CFG rules).
QWEN = rf.FamilyFields(
    "Qwen-Image",
    (Knob("true_cfg_scale", "number", "true CFG", 0.0, 100.0),),
    {},
    CfgFacts(
        "true_cfg_scale", 4.0, needs_negative=True, default_negative=False, guidance_used=False
    ),
)
WAN_KNOBS = (
    Knob("guidance_scale_2", "number", "g2", 0.0, 100.0),
    Knob("boundary_ratio", "number", "b", 0.0, 1.0),
    Knob("flow_shift", "number", "f", 0.1, 100.0),
)


def wan(default_guidance: float = 5.0, boundary: float | None = 0.875) -> rf.FamilyFields:
    cfg = CfgFacts(
        "guidance_scale", default_guidance, False, False, True, "guidance_scale_2", boundary
    )
    return rf.FamilyFields("Wan2.2", WAN_KNOBS, {}, cfg)


def image_limits(family=QWEN) -> ImageLimits:
    return ImageLimits.build(STAGE, None, family)


def refusal(fn, *args) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    return info.value


def test_family_catalogue_is_what_the_adapters_declare():
    cat = rf.family_catalogue()
    names = {fam: {k.name for k in knobs} for fam, knobs in cat.items()}
    assert names["Qwen-Image"] == names["Qwen-Image-Edit"] == names["FLUX"] == {"true_cfg_scale"}
    assert names["Wan2.2"] == {"guidance_scale_2", "boundary_ratio", "flow_shift"}


def test_a_knob_of_the_family_is_checked_and_carried():
    body = {"prompt": "a", "true_cfg_scale": 3, "negative_prompt": "n"}
    valid = validate_request(body, image_limits())
    assert valid.knobs == {"true_cfg_scale": 3.0}
    for value, code in ((-1, "invalid_value"), ("3", "invalid_type"), (True, "invalid_type")):
        err = refusal(validate_request, {**body, "true_cfg_scale": value}, image_limits())
        assert (err.status, err.param, err.code) == (400, "true_cfg_scale", code)


def test_fields_the_cfg_rule_leaves_unread_are_refused_before_any_stage():
    """Qwen-Image's true CFG needs a negative prompt and a scale > 1 (diffusers' rule), and
    its guidance_scale is read only by a guidance-distilled transformer (not this one)."""
    for body, param in (
        ({"true_cfg_scale": 3}, "true_cfg_scale"),  # no negative prompt
        ({"negative_prompt": "n", "true_cfg_scale": 1}, "negative_prompt"),
        ({"negative_prompt": "n", "true_cfg_scale": 0.5}, "negative_prompt"),
        ({"guidance_scale": 4.0}, "guidance_scale"),  # diffusers ignores it here
        ({"negative_prompt": "n", "guidance_scale": 3}, "guidance_scale"),  # CFG: 4.0, not 3
        ({"negative_prompt": "n", "guidance_scale": 3, "true_cfg_scale": 3}, "guidance_scale"),
    ):
        err = refusal(validate_request, {"prompt": "a", **body}, image_limits())
        assert (err.param, err.code) == (param, "invalid_value"), (body, err.message)
    validate_request({"prompt": "a", "negative_prompt": "n"}, image_limits())  # default 4.0


def test_refusals_name_the_field_and_say_who_takes_it():
    err = refusal(validate_request, {"prompt": "a", "flow_shift": 3.0}, image_limits())
    assert (err.param, err.code) == ("flow_shift", "unknown_parameter")
    assert "Wan2.2" in err.message
    # `lora` is taken (serving/lora_adapters.py); a malformed one names the part at fault.
    err = refusal(validate_request, {"prompt": "a", "lora": [{"name": 3}]}, image_limits())
    assert err.param == "lora[0].name" and "adapter name" in err.message
    err = refusal(validate_request, {"prompt": "a", "whatever": 1}, image_limits())
    assert (err.param, err.code) == ("whatever", "unknown_parameter")
    err = refusal(validate_request, {"prompt": "a", "seconds": 4}, image_limits())
    assert "/v1/videos" in err.message  # another route takes it
    # OpenAI's choices for its own models: what we do is accepted, the rest refused.
    validate_request({"prompt": "a", "quality": "auto", "background": "opaque"}, image_limits())
    for name, value in (("quality", "hd"), ("background", "transparent"), ("style", "vivid")):
        err = refusal(validate_request, {"prompt": "a", name: value}, image_limits())
        assert err.param == name and err.status == 400
    # A common field the family does not apply.
    glm = rf.FamilyFields("GLM-Image", (), {"negative_prompt": "no negative prompt"})
    err = refusal(validate_request, {"prompt": "a", "negative_prompt": "x"}, image_limits(glm))
    assert err.param == "negative_prompt" and "GLM-Image" in err.message


def test_output_format_any_case_and_jpg():
    for spelled in ("JPG", "jpg", "Jpeg", "JPEG"):
        valid = validate_request({"prompt": "a", "output_format": spelled}, image_limits())
        assert valid.output_format == "jpeg"
    assert (
        validate_request({"prompt": "a", "output_format": "PNG"}, image_limits()).output_format
        == "png"
    )
    err = refusal(validate_request, {"prompt": "a", "output_format": "gif"}, image_limits())
    assert err.param == "output_format"


def test_response_format_file_is_not_a_stream():
    assert validate_request({"prompt": "a", "response_format": "file"}, image_limits())
    err = refusal(
        validate_request, {"prompt": "a", "response_format": "file", "stream": True}, image_limits()
    )
    assert err.param == "response_format"


def test_fields_a_request_would_not_read_are_refused():
    """Stream-only fields without a stream, a response format a stream does not use, and a
    lossy-format quality on PNG: each a 400 naming it, never accepted and ignored."""
    for body, param in (
        ({"partial_images": 2}, "partial_images"),
        ({"progress_events": True}, "progress_events"),
        ({"stream": True, "response_format": "url"}, "response_format"),
        ({"output_compression": 50}, "output_compression"),  # PNG, the default
        ({"output_compression": 50, "output_format": "PNG"}, "output_compression"),
    ):
        err = refusal(validate_request, {"prompt": "a", **body}, image_limits())
        assert (err.status, err.param, err.code) == (400, param, "invalid_value"), body
    # The same fields where they are read, and the values that ask for nothing.
    for body in (
        {"stream": True, "partial_images": 2, "progress_events": True},
        {"stream": True, "response_format": "b64_json"},
        {"partial_images": 0, "progress_events": False, "stream": False},
        {"output_compression": 50, "output_format": "jpg"},
        {"output_compression": 50, "output_format": "webp"},
    ):
        validate_request({"prompt": "a", **body}, image_limits())


def test_file_answer_one_image_or_a_zip():
    one = file_answer([b"\xff\xd8jpeg"], "jpeg", "img-1")
    assert (one.content, one.media_type, one.filename) == (
        b"\xff\xd8jpeg",
        "image/jpeg",
        "img-1.jpg",
    )
    two = file_answer([b"a", b"b"], "png", "img-2")
    assert two.media_type == "application/zip" and two.filename == "img-2.zip"
    with zipfile.ZipFile(io.BytesIO(two.content)) as zf:
        assert [(n, zf.read(n)) for n in zf.namelist()] == [
            ("image_0.png", b"a"),
            ("image_1.png", b"b"),
        ]


def test_knob_check_rejects_undeclared_knobs():
    with pytest.raises(KnobError) as info:
        check_knobs(QWEN.knobs, {"flow_shift": 1.0})
    assert info.value.name == "flow_shift" and info.value.code == "unknown_parameter"
    assert check_knobs(QWEN.knobs, {"true_cfg_scale": 2}) == {"true_cfg_scale": 2.0}


def test_a_route_wide_extension_joins_the_table(monkeypatch):
    """How another field (e.g. a per-request cache choice) declares itself: one entry."""

    def check(value):
        if value not in ("on", "off"):
            raise APIError(400, "cache must be on or off", param="cache", code="invalid_value")
        return value

    ext = rf.RequestField("cache", (rf.GENERATIONS,), {"type": "string"}, check)
    monkeypatch.setattr(rf, "EXTENSIONS", [ext])
    assert validate_request({"prompt": "a", "cache": "on"}, image_limits()).extensions == {
        "cache": "on"
    }
    assert refusal(validate_request, {"prompt": "a", "cache": 1}, image_limits()).param == "cache"
    assert "cache" in rf.body_schema(rf.GENERATIONS)["properties"]
    assert "cache" not in rf.body_schema(rf.VIDEOS)["properties"]


# ---- videos ------------------------------------------------------------------------------
def video_bounds(default_guidance: float = 5.0, boundary: float | None = 0.875) -> VideoBounds:
    facts = {"frame_step": 4, "default_num_frames": 81}
    family = wan(default_guidance, boundary)
    return VideoBounds(STAGE, facts, family, ServingLimits(), ["wan"], 16, 65)


def test_video_size_from_width_and_height_and_conflicts():
    req = check_video_request({"prompt": "a", "width": 48, "height": 32}, video_bounds())
    assert (req["width"], req["height"]) == (48, 32)
    same = check_video_request(
        {"prompt": "a", "size": "48x32", "width": "48", "height": "32"}, video_bounds()
    )
    assert (same["width"], same["height"]) == (48, 32)  # form values arrive as text
    for body, param in (
        ({"size": "32x32", "width": 48, "height": 32}, "size"),
        ({"width": 48}, "height"),
        ({"height": 48}, "width"),
        ({"width": 50, "height": 32}, "width"),
        ({"width": 32, "height": 1000}, "height"),
        ({"seconds": 3, "num_frames": 5}, "num_frames"),
    ):
        assert refusal(check_video_request, {"prompt": "a", **body}, video_bounds()).param == param
    both = check_video_request({"prompt": "a", "seconds": 1, "num_frames": 17}, video_bounds())
    assert (both["num_frames"], both["seconds"]) == (17, "1")


def test_video_knobs_are_typed_checked_and_echoed():
    req = check_video_request(
        {"prompt": "a", "guidance_scale_2": "2.5", "flow_shift": 8, "boundary_ratio": 0.5},
        video_bounds(),
    )
    assert req["knobs"] == {"guidance_scale_2": 2.5, "flow_shift": 8.0, "boundary_ratio": 0.5}
    assert refusal(
        check_video_request, {"prompt": "a", "boundary_ratio": 2}, video_bounds()
    ).param == ("boundary_ratio")
    err = refusal(check_video_request, {"prompt": "a", "true_cfg_scale": 2}, video_bounds())
    assert err.param == "true_cfg_scale" and "Qwen-Image" in err.message
    # Without CFG (guidance <= 1) the low-noise scale and a negative prompt would be ignored.
    no_cfg = video_bounds(default_guidance=1.0)
    assert refusal(check_video_request, {"prompt": "a", "guidance_scale_2": 2}, no_cfg).param == (
        "guidance_scale_2"
    )
    assert refusal(check_video_request, {"prompt": "a", "negative_prompt": "x"}, no_cfg).param == (
        "negative_prompt"
    )
    check_video_request({"prompt": "a", "guidance_scale": 3, "guidance_scale_2": 2}, no_cfg)


def test_guidance_scale_2_without_a_low_noise_step_is_refused_before_any_stage():
    """diffusers' WanPipeline guides with guidance_scale_2 only the steps whose timestep lies
    below boundary_ratio * num_train_timesteps (the low-noise expert): with boundary_ratio 0,
    the model's or the request's, there are none, so the field is a 400 naming it."""
    one_expert = video_bounds(boundary=0.0)
    err = refusal(check_video_request, {"prompt": "a", "guidance_scale_2": 2}, one_expert)
    assert err.param == "guidance_scale_2" and "boundary_ratio 0" in err.message
    two = video_bounds()
    body = {"prompt": "a", "guidance_scale_2": 2, "boundary_ratio": 0}
    assert refusal(check_video_request, body, two).param == "guidance_scale_2"
    # A switch the request moves later makes the second expert run again; without
    # guidance_scale_2, boundary_ratio 0 is a real choice (the high-noise expert throughout).
    check_video_request({**body, "boundary_ratio": 0.5}, one_expert)
    check_video_request({"prompt": "a", "boundary_ratio": 0}, two)


# ---- edits by URL --------------------------------------------------------------------------
def test_data_urls():
    png = b"\x89PNG\r\n\x1a\nrest"
    assert decode_data_url("image/png;base64," + base64.b64encode(png).decode(), "url", 100) == png
    assert decode_data_url(",abc%20d", "url", 100) == b"abc d"
    for bad in ("image/png;base64", "image/png;base64,@@@"):
        assert refusal(decode_data_url, bad, "url", 100).param == "url"
    big = "image/png;base64," + base64.b64encode(b"x" * 200).decode()
    assert refusal(decode_data_url, big, "url", 100).status == 413


@pytest.fixture
def image_host():
    body = b"\x89PNG-bytes"
    with MediaHost({"/a.png": body}, redirects={"/moved": "/a.png"}) as host:
        yield host.url, body


def test_remote_urls_only_from_listed_hosts(image_host):
    base, body = image_host
    fetch = lambda url, hosts, limit=1000: asyncio.run(fetch_url(url, "url", hosts, limit))  # noqa: E731
    err = refusal(fetch, f"{base}/a.png", ())  # the default: no host
    assert (err.param, err.code) == ("url", "url_not_allowed")
    assert fetch(f"{base}/a.png", ("127.0.0.1",)) == body
    assert (
        refusal(fetch, f"{base}/moved", ("127.0.0.1",)).code == "url_fetch_failed"
    )  # no redirects
    assert refusal(fetch, f"{base}/a.png", ("127.0.0.1",), 4).status == 413
    assert refusal(fetch, "ftp://127.0.0.1/a.png", ("127.0.0.1",)).code == "invalid_url"


def test_edit_url_hosts_is_a_typed_config_field():
    assert ServingLimits().edit_url_hosts == ()
    assert ServingLimits(edit_url_hosts=["Images.Example.com"]).edit_url_hosts == (
        "images.example.com",
    )
    with pytest.raises(ValueError, match="edit_url_hosts"):
        ServingLimits(edit_url_hosts=["https://images.example.com/x"])
