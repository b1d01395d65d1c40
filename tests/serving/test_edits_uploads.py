"""The edits route's upload checks and conversions (serving/edits.py), without a server:
every registered pipeline's topology decides whether it takes images and masks, and bad files
are refused with OpenAI-shaped 400/413 errors before anything is decoded further."""

from __future__ import annotations

import io
import zlib

import numpy as np
import pytest
from PIL import Image

from vllm_omni_plugin.pipelines import available_pipelines, get_pipeline
from vllm_omni_plugin.serving.edits import (
    MAX_IMAGE_BYTES,
    check_topology,
    decode_uploads,
    form_fields,
    open_checked,
)
from vllm_omni_plugin.serving.errors import APIError


class Upload:
    """What Starlette's form parser hands over for a file part (filename + async read)."""

    def __init__(self, data: bytes, filename: str = "f.png"):
        self.filename, self.data = filename, data

    async def read(self) -> bytes:
        return self.data


def png(size=(32, 24), mode="RGB", color=(10, 200, 30)) -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, color if mode != "1" else 0).save(out, format="PNG")
    return out.getvalue()


def code_of(fn, *args) -> tuple[int, str | None, str | None]:
    with pytest.raises(APIError) as info:
        fn(*args)
    err = info.value
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    return err.status, err.code, err.param


def test_each_topology_decides_images_and_masks():
    img = [Upload(png())]
    for key in available_pipelines():
        topo = get_pipeline(key)
        if topo.max_input_images == 0:  # text-to-image only: 400 before any file is read
            assert code_of(check_topology, topo, img, None)[:2] == (400, "unsupported_endpoint")
            continue
        check_topology(topo, img, None)
        too_many = [Upload(png())] * (topo.max_input_images + 1)
        assert code_of(check_topology, topo, too_many, None)[1] == "too_many_images"
        if not topo.accepts_mask:
            assert code_of(check_topology, topo, img, Upload(png()))[1] == "unsupported_parameter"
    edit = get_pipeline("qwen_image_edit")
    assert (edit.max_input_images, edit.requires_input_image, edit.accepts_mask) == (1, True, False)
    assert get_pipeline("qwen_image").max_input_images == 0
    assert code_of(check_topology, edit, [], None)[1] == "missing_required_parameter"


def test_form_fields_types_and_names():
    data, images, mask = form_fields(
        [
            ("image[]", Upload(png())),
            ("image[]", Upload(png())),
            ("prompt", "p"),
            ("n", "2"),
            ("stream", "true"),
            ("guidance_scale", "3.5"),
            ("quality", "high"),  # typed here; validation refuses it (request_fields.py)
        ]
    )
    assert len(images) == 2 and mask is None
    assert data == {"prompt": "p", "n": 2, "stream": True, "guidance_scale": 3.5, "quality": "high"}
    assert code_of(form_fields, [("images", Upload(png()))])[1:] == ("unknown_parameter", "images")
    assert code_of(form_fields, [("image", "x.png")])[1] == "invalid_type"
    assert code_of(form_fields, [("n", "two")])[1:] == ("invalid_type", "n")
    assert code_of(form_fields, [("stream", "yes")])[1] == "invalid_type"


def test_bad_files_are_refused_before_decoding():
    good = png()
    assert code_of(open_checked, b"GIF89a not really", "image")[1] == "invalid_image_format"
    assert code_of(open_checked, good[: len(good) // 2], "image")[1] == "invalid_image"
    assert code_of(open_checked, b"", "image")[1] == "invalid_image"
    too_big = good + b"\0" * MAX_IMAGE_BYTES
    assert code_of(open_checked, too_big, "image")[:2] == (413, "file_too_large")
    gif = io.BytesIO()
    Image.new("RGB", (4, 4)).save(gif, format="GIF")
    assert code_of(open_checked, gif.getvalue(), "image")[1] == "invalid_image_format"


def test_decompression_bomb_is_refused_from_its_header():
    """A PNG whose header declares 100 MP, with no pixel data at all: refused by size, so the
    check cannot be decoding it."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body).to_bytes(4, "big")
        return len(body).to_bytes(4, "big") + kind + body + crc

    header = (10000).to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])
    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")
    status, code, param = code_of(open_checked, bomb, "image")
    assert (status, code, param) == (400, "image_too_large", "image")
    # Past twice PIL's own limit PIL refuses at open: the same answer.
    header = (20000).to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])
    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")
    assert code_of(open_checked, bomb, "image")[1] == "image_too_large"


def test_uploads_become_rgb_pngs_and_an_l_mask():
    rgba = np.zeros((24, 32, 4), dtype=np.uint8)
    rgba[..., :3] = np.arange(32, dtype=np.uint8)[None, :, None] * 7
    rgba[..., 3] = 255
    rgba[:10, :10, 3] = 0  # the area to edit
    src = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(src, format="PNG")
    images, mask = decode_uploads([src.getvalue(), png()], src.getvalue())
    first = Image.open(io.BytesIO(images[0]))
    assert first.format == "PNG" and first.mode == "RGB" and first.size == (32, 24)
    assert (np.asarray(first) == rgba[..., :3]).all()
    m = np.asarray(Image.open(io.BytesIO(mask)))
    assert m.dtype == np.uint8 and m.shape == (24, 32)
    assert (m[:10, :10] == 255).all() and m[10:, :].max() == 0 and m[:, 10:].max() == 0
    # A mask without alpha, or of another size, is a 400.
    assert code_of(decode_uploads, [png()], png())[1] == "invalid_mask"
    assert code_of(decode_uploads, [png()], png((8, 8), "RGBA"))[1] == "invalid_mask"


def test_edit_params_cross_the_multinode_link():
    """GenerationParams carries the uploads as PNG bytes so they stay plain data on the
    msgpack links (the node link and a stage's socket; arrays would not encode there)."""
    from vllm_omni_plugin.common.link_messages import ToStage, decode_link
    from vllm_omni_plugin.common.messages import GenerationParams, Submit, decode_to_stage, encode

    images, mask = decode_uploads([png(), png((32, 24), "RGB", (1, 2, 3))], png((32, 24), "RGBA"))
    params = GenerationParams("x", seed=3, input_images=images, mask=mask)
    back = decode_link(encode(ToStage(1, Submit("r", params)))).msg.params
    assert back == params and back.input_images[1] == images[1]
    assert decode_to_stage(encode(Submit("r", params))).params == params


def test_auto_size_keeps_the_source_aspect_at_the_default_area():
    from vllm_omni_plugin.common.limits import RequestLimits
    from vllm_omni_plugin.serving.edits import auto_size
    from vllm_omni_plugin.serving.protocol import ImageLimits

    stage = RequestLimits(16, 64, 64, 1024, 1024, 50, 4, 512, 512)
    limits = ImageLimits.build(stage, None)
    assert auto_size((512, 512), limits) == (512, 512)
    assert auto_size((1536, 1024), limits) == (624, 416)  # 3:2 at ~512x512 on the 16 grid
    assert auto_size((1000, 10), limits) == (1024, 64)  # clamped into the bounds
    w, h = auto_size((480, 640), limits)
    assert w % 16 == 0 and h % 16 == 0 and abs(w / h - 0.75) < 0.05


def test_a_source_beyond_the_pipelines_aspect_bound_is_a_400():
    # GLM-Image's vision tokenizer refuses sources over 4:1: the route says so, not the AR stage.
    bound = get_pipeline("glm_image").max_input_aspect_ratio
    assert bound == 4.0
    images, _ = decode_uploads([png((128, 32))], None, bound)  # 4:1 is fine
    assert len(images) == 1
    with pytest.raises(APIError) as err:
        decode_uploads([png((32, 33)), png((165, 32))], None, bound)
    assert err.value.status == 400 and err.value.param == "image[1]"
    assert decode_uploads([png((165, 32))], None, None)[0]  # no bound: accepted


def test_form_cache_field_as_nested_form_keys_or_json():
    # The openai client writes extra_body={"cache": {...}} into a form as cache[key] fields.
    data, _, _ = form_fields(
        [("prompt", "p"), ("cache[policy]", "first_block"), ("cache[threshold]", "0.1")]
    )
    assert data["cache"] == {"policy": "first_block", "threshold": 0.1}
    data, _, _ = form_fields([("cache", '{"policy": "taylorseer", "interval": 3}')])
    assert data["cache"] == {"policy": "taylorseer", "interval": 3}
    assert code_of(form_fields, [("cache", "fast")])[1:] == ("invalid_type", "cache")
    bad = [("cache[policy]", "teacache"), ("cache[threshold]", "low")]
    assert code_of(form_fields, bad)[1:] == ("invalid_type", "cache.threshold")


def test_source_images_below_the_pipelines_smallest_side_are_a_400():
    """FLUX.2 klein (diffusers: at least 64 pixels a side) refuses smaller uploads up front."""
    side = get_pipeline("flux2_klein").min_input_side
    assert side == 64
    assert decode_uploads([png((64, 80))], None, None, side)[0]
    with pytest.raises(APIError) as info:
        decode_uploads([png((64, 64)), png((80, 63))], None, None, side)
    assert (info.value.status, info.value.param, info.value.code) == (
        400,
        "image[1]",
        "invalid_image_size",
    )
