"""Qwen2-VL's video preprocessing (what Qwen3-Omni's processor runs on video parts) in plain torch,
for installs without torchvision.

transformers implements `Qwen2VLVideoProcessor` on torchvision's tensor transforms only, and vLLM's
CPU builds have no torchvision that loads (entry_points/patches.py, patch 7). The steps are the
model's preprocessing, done with the torch operations torchvision's own kernels reduce to:

* frames sampled uniformly (`num_frames`, or `fps` from the video's metadata), their count rounded
  to the temporal patch size;
* each frame resized to the closest size whose sides are multiples of patch_size * merge_size and
  whose area lies between `size["shortest_edge"]` and `size["longest_edge"]` pixels (Qwen2-VL's
  `smart_resize`), bicubic (the checkpoints' `resample`) with antialiasing:
  `torch.nn.functional.interpolate`, on uint8 frames natively on the CPU (torchvision does the
  same there), elsewhere in float32, clamped, rounded;
* rescaled and normalized in one step (mean and std divided by the rescale factor), as the
  processors' base class does;
* cut into patches of temporal_patch_size x patch_size x patch_size, ordered so that each
  merge_size x merge_size block of patches is contiguous (the order the vision encoder's merger
  expects), the frame count padded with the last frame to a multiple of temporal_patch_size.

Outputs: `pixel_values_videos` (patches x C*T*P*P) and `video_grid_thw`, as transformers gives.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.processing_utils import VideosKwargs
from transformers.video_processing_utils import BaseVideoProcessor


class Qwen2VLVideoKwargs(VideosKwargs, total=False):
    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool
    max_video_tokens: int


# PIL's resampling filter numbers (the processor's `resample`) -> interpolate's mode.
MODES = {int(PILImageResampling.BILINEAR): "bilinear", int(PILImageResampling.BICUBIC): "bicubic"}


def resize_frames(
    frames: torch.Tensor, height: int, width: int, mode: str = "bicubic"
) -> torch.Tensor:
    """(..., C, H, W) frames resized to (height, width) with antialiasing, in their dtype, as
    torchvision resizes tensors: uint8 natively on the CPU where torch has the kernel (bicubic;
    bilinear with AVX2), otherwise in float32, then clamped (bicubic) and rounded back."""
    if tuple(frames.shape[-2:]) == (height, width):
        return frames
    lead, (c, h, w) = frames.shape[:-3], frames.shape[-3:]
    flat = frames.reshape(-1, c, h, w)
    native_uint8 = flat.device.type == "cpu" and (
        mode == "bicubic" or "AVX2" in torch.backends.cpu.get_cpu_capability()
    )
    native = flat.dtype in (torch.float32, torch.float64) or (
        flat.dtype == torch.uint8 and native_uint8
    )
    x = flat if native else flat.to(torch.float32)
    out = torch.nn.functional.interpolate(
        x, size=[height, width], mode=mode, align_corners=False, antialias=True
    )
    if not native:
        if mode == "bicubic" and flat.dtype == torch.uint8:
            out = out.clamp_(0, 255)
        if not flat.dtype.is_floating_point:
            out = out.round_()
        out = out.to(flat.dtype)
    return out.reshape(*lead, c, height, width)


class Qwen2VLVideoProcessor(BaseVideoProcessor):
    """transformers' `Qwen2VLVideoProcessor` (same name, settings and outputs) without
    torchvision; loaded where the checkpoint names that class."""

    resample = PILImageResampling.BICUBIC
    size = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}
    image_mean = OPENAI_CLIP_MEAN
    image_std = OPENAI_CLIP_STD
    do_resize = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = True
    patch_size = 14
    temporal_patch_size = 2
    merge_size = 2
    min_frames = 4
    max_frames = 768
    do_sample_frames = False
    cap_pixels_per_frame = None
    max_video_tokens = 128000
    valid_kwargs = Qwen2VLVideoKwargs
    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, **kwargs: Any) -> None:
        # min_pixels / max_pixels are the older names of size's two bounds.
        size = dict(kwargs.pop("size", None) or self.size)
        if (min_pixels := kwargs.pop("min_pixels", None)) is not None:
            size["shortest_edge"] = min_pixels
        if (max_pixels := kwargs.pop("max_pixels", None)) is not None:
            size["longest_edge"] = max_pixels
        size.pop("min_pixels", None)
        size.pop("max_pixels", None)
        super().__init__(size=size, **kwargs)

    def _standardize_kwargs(
        self,
        size: Any = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        **kwargs: Any,
    ) -> dict:
        # A call's min_pixels / max_pixels set the bounds of its size, as at construction.
        if min_pixels is not None or max_pixels is not None:
            bounds = dict(size or self.size)
            if min_pixels is not None:
                bounds["shortest_edge"] = min_pixels
            if max_pixels is not None:
                bounds["longest_edge"] = max_pixels
            size = bounds
        return super()._standardize_kwargs(size=size, **kwargs)

    # ---- frames ------------------------------------------------------------------------
    def sample_frames(
        self,
        metadata: Any,
        temporal_patch_size: int | None = None,
        min_frames: int | None = None,
        max_frames: int | None = None,
        num_frames: int | None = None,
        fps: float | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Indices of the frames kept: `num_frames` of them, or `fps` per second of video,
        within [min_frames, max_frames], a multiple of the temporal patch size."""
        if fps is not None and num_frames is not None:
            raise ValueError("num_frames and fps are mutually exclusive; give one")
        num_frames = self.num_frames if num_frames is None else num_frames
        fps = self.fps if fps is None else fps
        tps = self.temporal_patch_size if temporal_patch_size is None else temporal_patch_size
        min_frames = self.min_frames if min_frames is None else min_frames
        max_frames = self.max_frames if max_frames is None else max_frames
        total = metadata.total_num_frames
        if num_frames is not None:
            num_frames = round(num_frames / tps) * tps
        elif fps is not None:
            if metadata.fps is None:
                raise ValueError("sampling by fps needs the video's fps in its metadata")
            most = math.floor(min(max_frames, total) / tps) * tps
            wanted = min(max(total / metadata.fps * fps, min_frames), most, total)
            num_frames = math.floor(wanted / tps) * tps
        if num_frames is not None and num_frames > total:
            raise ValueError(f"cannot sample {num_frames} frames from a video of {total}")
        if num_frames is None:
            return torch.arange(0, total).int()
        return torch.arange(0, total, total / num_frames).int()

    def convert_to_rgb(self, video: torch.Tensor) -> torch.Tensor:
        """Grayscale frames repeated to three channels; others as they are."""
        if video.shape[-3] == 1:
            return video.expand(*video.shape[:-3], 3, *video.shape[-2:]).contiguous()
        return video

    # ---- per pixel ---------------------------------------------------------------------
    def target_size(
        self, video: torch.Tensor, size: Any, factor: int, temporal_factor: int, cap: bool
    ) -> tuple[int, int]:
        max_pixels = size.longest_edge
        if cap:  # each frame's share of the whole video's pixel budget
            budget = int(self.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(
                min(max_pixels, budget * temporal_factor // video.shape[0]),
                int(size.shortest_edge * 1.05),
            )
        h, w = video.shape[-2:]
        return smart_resize(
            h, w, factor=factor, min_pixels=size.shortest_edge, max_pixels=max_pixels
        )

    def normalize(
        self, image: torch.Tensor, mean: Any, std: Any, inplace: bool = False, **kwargs: Any
    ) -> torch.Tensor:
        mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=image.dtype, device=image.device).view(-1, 1, 1)
        out = image if inplace else image.clone()
        return out.sub_(mean).div_(std)

    # ---- patches -----------------------------------------------------------------------
    @staticmethod
    def patchify(
        video: torch.Tensor, patch_size: int, merge_size: int, temporal_patch_size: int
    ) -> tuple[torch.Tensor, int, int, int]:
        """(T, C, H, W) -> (grid_t * grid_h * grid_w, C * tps * P * P) and the grid."""
        if pad := -video.shape[0] % temporal_patch_size:
            video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
        frames, channels, height, width = video.shape
        gt, gh, gw = frames // temporal_patch_size, height // patch_size, width // patch_size
        blocks = video.reshape(
            gt,
            temporal_patch_size,
            channels,
            gh // merge_size,
            merge_size,
            patch_size,
            gw // merge_size,
            merge_size,
            patch_size,
        )
        # (t, block row, block col, row in block, col in block) x (C, tps, P, P)
        blocks = blocks.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        flat = blocks.reshape(gt * gh * gw, channels * temporal_patch_size * patch_size**2)
        return flat, gt, gh, gw

    def _preprocess(
        self,
        videos: list[torch.Tensor],
        do_resize: bool,
        size: Any,
        resample: Any,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        image_mean: Any,
        image_std: Any,
        patch_size: int | None = None,
        temporal_patch_size: int | None = None,
        merge_size: int | None = None,
        cap_pixels_per_frame: bool | None = None,
        return_tensors: Any = None,
        **kwargs: Any,
    ) -> BatchFeature:
        patch_size = patch_size or self.patch_size
        merge_size = merge_size or self.merge_size
        tps = temporal_patch_size or self.temporal_patch_size
        mode = MODES.get(int(self.resample if resample is None else resample))
        if do_resize and mode is None:
            raise ValueError(
                f"resample {resample!r}: this video processor resizes with bilinear (2) or "
                "bicubic (3) filters only"
            )
        patches, grids = [], []
        for video in videos:
            if do_resize:
                h, w = self.target_size(
                    video, size, patch_size * merge_size, tps, bool(cap_pixels_per_frame)
                )
                video = resize_frames(video, h, w, mode)
            video = self.rescale_and_normalize(
                video, do_rescale, rescale_factor, do_normalize, image_mean, image_std
            )
            flat, gt, gh, gw = self.patchify(video, patch_size, merge_size, tps)
            patches.append(flat)
            grids.append([gt, gh, gw])
        return BatchFeature(
            data={"pixel_values_videos": torch.cat(patches), "video_grid_thw": torch.tensor(grids)},
            tensor_type=return_tensors,
        )

    def get_num_of_video_patches(
        self, num_frames: int, height: int, width: int, videos_kwargs: dict | None = None
    ) -> int:
        kw = videos_kwargs or {}
        size = kw.get("size") or self.size
        patch = kw.get("patch_size") or self.patch_size
        merge = kw.get("merge_size") or self.merge_size
        tps = kw.get("temporal_patch_size") or self.temporal_patch_size
        h, w = smart_resize(
            height,
            width,
            factor=patch * merge,
            min_pixels=size["shortest_edge"],
            max_pixels=size["longest_edge"],
        )
        return math.ceil(num_frames / tps) * (h // patch) * (w // patch)
