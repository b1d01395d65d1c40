"""The torch-only Qwen2-VL video processor (models/qwen3_omni/video_processor.py), which Qwen3-Omni
stages load where torchvision is absent.

- Patch order: every row of `pixel_values_videos` is one (temporal x spatial) patch, rows grouped
  by 2 x 2 merge blocks; rebuilding the frames from the rows by that layout gives back exactly
  the normalized, resized frames (tolerance 0).
- Resizing: bicubic with antialiasing as torchvision runs it for uint8 frames on the CPU
  (torch's native uint8 kernel), and in float32 with clamping and rounding elsewhere; the
  smart_resize bounds and frame pairing give the expected grid.
- Where torchvision is installed (GPU machines): its output equals transformers' own
  `Qwen2VLVideoProcessor` exactly, pixel values and grid (skipped here without it).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from vllm_omni_plugin.models.qwen3_omni.video_processor import (
    Qwen2VLVideoProcessor,
    resize_frames,
)


def frames(n: int = 5, height: int = 60, width: int = 90, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, height, width, 3), dtype=np.uint8)


def unpatchify(rows: torch.Tensor, grid: list[int], p: int = 14, m: int = 2, t: int = 2):
    """(T', C, H, W) frames back from the rows, by the documented layout: rows ordered by
    (time, block row, block column, row in block, column in block), each row (C, t, p, p)."""
    gt, gh, gw = grid
    out = torch.empty(gt * t, 3, gh * p, gw * p)
    k = 0
    for tt in range(gt):
        for br in range(gh // m):
            for bc in range(gw // m):
                for r in range(m):
                    for c in range(m):
                        patch = rows[k].reshape(3, t, p, p)
                        y, x = (br * m + r) * p, (bc * m + c) * p
                        out[tt * t : (tt + 1) * t, :, y : y + p, x : x + p] = patch.permute(
                            1, 0, 2, 3
                        )
                        k += 1
    assert k == rows.shape[0]
    return out


def test_rows_rebuild_the_resized_normalized_frames_exactly():
    proc = Qwen2VLVideoProcessor()
    video = frames()
    out = proc([video], return_tensors="pt")
    (grid,) = out["video_grid_thw"].tolist()
    # 5 frames padded to 6 (the last repeated), paired; 60x90 raised to the least area in
    # multiples of 28: 280x392.
    assert grid == [3, 20, 28]
    rebuilt = unpatchify(out["pixel_values_videos"], grid)
    x = torch.from_numpy(video).permute(0, 3, 1, 2).contiguous()
    x = resize_frames(x, 280, 392).to(torch.float32)
    mean = torch.tensor(proc.image_mean).view(-1, 1, 1) * 255
    std = torch.tensor(proc.image_std).view(-1, 1, 1) * 255
    want = (x - mean) / std
    want = torch.cat([want, want[-1:]])
    assert torch.equal(rebuilt, want)


def test_size_bounds_from_construction_and_from_a_call():
    """min_pixels / max_pixels (the older names) bound the frame area, at construction or per
    call; 60 x 90 frames capped at 28 x 28 x 4 pixels become 28 x 56 (a 2 x 4 patch grid)."""
    small = {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 4}
    by_init = Qwen2VLVideoProcessor(**small)([frames(2)], return_tensors="pt")
    by_call = Qwen2VLVideoProcessor()([frames(2)], return_tensors="pt", **small)
    for out in (by_init, by_call):
        assert out["video_grid_thw"].tolist() == [[1, 2, 4]]
    assert torch.equal(by_init["pixel_values_videos"], by_call["pixel_values_videos"])


def test_uint8_resize_on_the_cpu_is_the_native_kernel_elsewhere_float_rounded():
    x = torch.from_numpy(frames(2)).permute(0, 3, 1, 2).contiguous()
    native = torch.nn.functional.interpolate(
        x, size=[30, 40], mode="bicubic", align_corners=False, antialias=True
    )
    assert torch.equal(resize_frames(x, 30, 40), native)
    assert resize_frames(x, 60, 90) is x  # already that size
    halves = resize_frames(x.to(torch.int16), 30, 40)  # the cast path: float32, round, back
    assert halves.dtype == torch.int16
    assert (halves.to(torch.int32) - native.to(torch.int32)).abs().max() <= 1


def test_a_resample_filter_it_cannot_run_is_refused_not_ignored():
    bilinear = Qwen2VLVideoProcessor(resample=2)([frames(2)], return_tensors="pt")
    bicubic = Qwen2VLVideoProcessor()([frames(2)], return_tensors="pt")
    assert not torch.equal(bilinear["pixel_values_videos"], bicubic["pixel_values_videos"])
    with pytest.raises(ValueError, match="resample 1"):
        Qwen2VLVideoProcessor()([frames(2)], return_tensors="pt", resample=1)  # LANCZOS


def test_sampling_by_fps_pairs_frames_within_the_bounds():
    from transformers.video_utils import VideoMetadata

    proc = Qwen2VLVideoProcessor()
    meta = VideoMetadata(total_num_frames=40, fps=10.0, duration=4.0)
    assert proc.sample_frames(meta, fps=2).tolist() == [0, 5, 10, 15, 20, 25, 30, 35]
    assert proc.sample_frames(meta, num_frames=6).tolist() == [0, 6, 13, 20, 26, 33]
    # A count rounds to whole pairs (half to even: 5 -> 4).
    assert proc.sample_frames(meta, num_frames=5).tolist() == [0, 10, 20, 30]
    with pytest.raises(ValueError, match="mutually exclusive"):
        proc.sample_frames(meta, fps=2, num_frames=4)


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is None, reason="transformers' processor needs it"
)
def test_equals_transformers_torchvision_processor():
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import (
        Qwen2VLVideoProcessor as Reference,
    )

    for video in (frames(), frames(4, 200, 120, seed=1)):
        ours = Qwen2VLVideoProcessor()([video], return_tensors="pt")
        ref = Reference()([video], return_tensors="pt")
        assert torch.equal(ours["video_grid_thw"], ref["video_grid_thw"])
        assert torch.equal(ours["pixel_values_videos"], ref["pixel_values_videos"])
