"""The talker's 3-D positions (models/qwen3_omni/positions.py, prompt.py `positions`) against
transformers' talker `get_rope_index` on the tiny checkpoint's config: several images of other
grids among text, an image outside the user turns (not spoken to), and mismatches refused."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_plugin.models.qwen3_omni.positions import VisualGrid, talker_positions
from vllm_omni_plugin.models.qwen3_omni.prompt import load_conditioner


@pytest.fixture(scope="module")
def conditioner(omni_dir):
    return load_conditioner(omni_dir)


def _image_run(cfg, grid: VisualGrid) -> list[int]:
    merge = cfg.spatial_merge_size**2
    n = grid.t * grid.h * grid.w // merge
    return [cfg.vision_start_token_id, *[cfg.image_token_id] * n, cfg.vision_end_token_id]


def test_several_images_equal_transformers_get_rope_index(omni_model):
    cfg = omni_model.config.talker_config
    grids = [VisualGrid(1, 4, 6), VisualGrid(1, 2, 2), VisualGrid(2, 4, 4)]
    ids = [5, 6, *_image_run(cfg, grids[0]), 7, *_image_run(cfg, grids[1])]
    ids += [*_image_run(cfg, grids[2]), 8, 9, 10]
    got, delta = talker_positions(
        ids,
        grids,
        image_token_id=cfg.image_token_id,
        video_token_id=cfg.video_token_id,
        spatial_merge_size=cfg.spatial_merge_size,
        position_id_per_seconds=cfg.position_id_per_seconds,
    )
    thw = torch.tensor([[g.t, g.h, g.w] for g in grids])
    want, want_delta = omni_model.talker.get_rope_index(
        torch.tensor([ids]), thw, None, torch.ones(1, len(ids), dtype=torch.long)
    )
    torch.testing.assert_close(got, want[:, 0].long(), atol=0, rtol=0)
    assert delta == int(want_delta) != 0


def test_images_outside_the_user_turns_are_skipped_and_mismatches_refused(conditioner):
    cfg = conditioner.config
    tcfg = cfg.talker_config
    system_grid, user_grid = VisualGrid(1, 2, 2), VisualGrid(1, 4, 4)
    turn = [cfg.im_start_token_id, cfg.system_token_id, 11, *_image_run(tcfg, system_grid)]
    turn += [cfg.im_end_token_id, 12]
    user = [cfg.im_start_token_id, cfg.user_token_id, 13, *_image_run(tcfg, user_grid)]
    user += [cfg.im_end_token_id, 12]
    head = [cfg.im_start_token_id, cfg.assistant_token_id, 12]
    prompt = turn + user + head
    positions, delta = conditioner.positions(prompt, [system_grid, user_grid])
    alone, alone_delta = conditioner.positions(user + head, [user_grid])
    torch.testing.assert_close(positions, alone, atol=0, rtol=0)
    assert positions.shape[1] == conditioner.prefill_length(prompt) and delta == alone_delta
    with pytest.raises(ValueError, match="2 image/video runs in the prompt, 1 items"):
        conditioner.positions(prompt, [user_grid])
    with pytest.raises(ValueError, match="does not span"):
        conditioner.positions(prompt, [system_grid, VisualGrid(1, 2, 2)])
