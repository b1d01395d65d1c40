"""Our GLM-Image processors give vLLM one image placeholder per image item, as the real one does.

vLLM-Omni 0.26's GLM-Image AR model profiles image-to-image at start-up: a dummy image of
`vision_config.image_size` goes through the checkpoint's GlmImageProcessor, and vLLM needs one
contiguous run of `image_token_id` as long as the returned source grid implies (t*h*w). These
tests run transformers' own processor, loaded from the written files, through that check for the
tiny and the full-size layouts, and show the check catches a processor that gets it wrong.
"""

from __future__ import annotations

import json

import pytest

from vllm_omni_plugin.testing import full_glm_image as full
from vllm_omni_plugin.testing import tiny_glm_image as tiny
from vllm_omni_plugin.testing.glm_image_placeholders import _runs, check, main


@pytest.fixture(scope="module")
def full_processor_checkpoint(tmp_path_factory):
    """The full-size layout's processor and AR config (no weights: the check needs neither)."""
    root = tmp_path_factory.mktemp("glm-full-processor")
    tiny.build_processor(root / "processor", layout=full.FULL_LAYOUT)
    full.full_configs()["vision_language_encoder"].save_pretrained(root / "vision_language_encoder")
    return root


def _assert_one_placeholder(reports, image_token_id: int, grid: list[int]):
    assert [r.path for r in reports] == ["chat_template", "prompt_token"]
    for r in reports:
        assert r.image_token_id == image_token_id
        assert r.source_grid == grid
        assert r.expected == grid[0] * grid[1] * grid[2] >= 1
        assert r.runs == [r.expected], r  # one contiguous placeholder of the grid's length
        assert r.image_tokens == r.expected
        assert r.ok


def test_tiny_checkpoint_expands_the_image_placeholder(tiny_models):
    # 256 px dummy image, halved by GLM-Image's smart_resize, 16 px patches: an 8x8 grid.
    _assert_one_placeholder(check(tiny_models("glm-image")), tiny.IMAGE_TOKEN_ID, [1, 8, 8])


def test_full_checkpoint_expands_the_image_placeholder(full_processor_checkpoint):
    # 2048 px dummy image (the vision encoder's image_size) -> 1024 px -> a 64x64 grid.
    _assert_one_placeholder(check(full_processor_checkpoint), full.IMAGE_TOKEN_ID, [1, 64, 64])


def test_check_catches_a_merging_image_processor(tiny_models):
    """merge_size 2 (transformers' class default) expands an image to a quarter of its grid's
    tokens: vLLM would find no placeholder of the grid's length, and so does the check."""
    from transformers import GlmImageProcessor

    processor = GlmImageProcessor.from_pretrained(tiny_models("glm-image") / "processor")
    processor.image_processor.merge_size = 2
    reports = check(tiny_models("glm-image"), processor=processor)
    assert not any(r.ok for r in reports)
    assert all(r.runs == [r.expected // 4] for r in reports), reports


@pytest.mark.parametrize("which", ["tiny", "full"])
def test_processor_folder_carries_the_image_processor_config(
    which, tiny_models, full_processor_checkpoint
):
    root = tiny_models("glm-image") if which == "tiny" else full_processor_checkpoint
    for name in ("preprocessor_config.json", "processor_config.json"):
        data = json.loads((root / "processor" / name).read_text())
        data = data.get("image_processor", data)
        assert (data["patch_size"], data["merge_size"], data["temporal_patch_size"]) == (16, 1, 1)


def test_cli_entry_reports_ok(full_processor_checkpoint, capsys):
    assert main([str(full_processor_checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "chat_template: ok" in out and "prompt_token: ok" in out
    assert json.loads(out.strip().splitlines()[-1]) == {"ok": True}


@pytest.mark.parametrize("which", ["tiny", "full"])
def test_plugin_vllm_processor_expands_real_images(which, tiny_models, full_processor_checkpoint):
    """Our model's vLLM-side processor (what vLLM calls for image-to-image requests) expands each
    `<|image|>` of a prompt to one contiguous run of the image's grid length, for real uploads
    (non-square, two images), exactly as GlmImageProcessor's own expansion does."""
    from PIL import Image
    from transformers import GlmImageProcessor

    from vllm_omni_plugin.models.glm_image.mm_processing import SourceImageProcessor

    root = tiny_models("glm-image") if which == "tiny" else full_processor_checkpoint
    hf = GlmImageProcessor.from_pretrained(root / "processor")
    ours = SourceImageProcessor(hf)
    images = [Image.new("RGB", (768, 512), (1, 2, 3)), Image.new("RGB", (300, 900), (4, 5, 6))]
    out = ours(text=f"{hf.image_token}a{hf.image_token}b", images=images, return_tensors="pt")
    grids = out["image_grid_thw"].tolist()
    assert len(grids) == 2 and out["pixel_values"].shape[0] == sum(t * h * w for t, h, w in grids)
    ids = out["input_ids"][0].tolist()
    assert _runs(ids, hf.image_token_id) == [t * h * w for t, h, w in grids]
    # The same expansion as the real processor's chat template path gives for these images.
    ref = hf(text=f"{hf.image_token}a{hf.image_token}b", images=images, return_tensors="pt")
    assert _runs(ref["input_ids"][0].tolist(), hf.image_token_id) == _runs(ids, hf.image_token_id)
