"""What the diffusion family tests share: random source images, requests, engines on the tiny
checkpoints (optionally keeping each request's final latents), diffusers reference runs that keep
the last step's latents, and the image / latent / video comparisons against those references.

The tolerances stay in each test module (they differ by family); these helpers only compare.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.adapters.loader import load_pipeline


def mean_abs_diff(a, b) -> float:
    """Mean absolute pixel difference of two PIL images on the 0-255 scale."""
    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    assert x.shape == y.shape, (x.shape, y.shape)
    return float(np.abs(x - y).mean())


def noise_image(seed: int, size: tuple[int, int] = (64, 48)) -> Image.Image:
    """Uniform noise of `size` (width, height) from numpy's legacy RandomState(seed)."""
    rs = np.random.RandomState(seed)
    return Image.fromarray((rs.rand(size[1], size[0], 3) * 255).astype(np.uint8))


def noise_picture(seed: int, width: int, height: int) -> Image.Image:
    """Uniform uint8 noise of width x height from numpy's default_rng(seed)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def square_request(rid: str, prompt: str, size: int, seed: int, steps: int, **fields):
    """A size x size GenerationRequest of `steps` steps; `fields` are its other fields."""
    return GenerationRequest(
        rid, prompt, height=size, width=size, num_inference_steps=steps, seed=seed, **fields
    )


def seeded(seed: int) -> torch.Generator:
    """The CPU generator the engine seeds a request with (diffusers' `generator=`)."""
    return torch.Generator("cpu").manual_seed(seed)


def reference_pipeline(pipeline_class, model_dir: Path, **components):
    """diffusers' `pipeline_class` from the tiny checkpoint, progress bar off."""
    pipe = pipeline_class.from_pretrained(str(model_dir), **components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_engine(model_dir: Path, max_batch_size: int = 4, min_size: int | None = None):
    """The engine on a tiny checkpoint; `min_size` lowers the smallest image it accepts (the
    default floor is larger than the 32x32 images of the fastest tests)."""
    sizes = {} if min_size is None else {"min_height": min_size, "min_width": min_size}
    config = DiffusionEngineConfig(model=str(model_dir), max_batch_size=max_batch_size, **sizes)
    return DiffusionEngine(config)


def latent_keeping_engine(adapter_class, model_dir: Path, max_batch_size: int = 8):
    """An engine on `adapter_class` (fp32, CPU) whose `final_latents` maps each request id to
    its final latents, the denoising state handed to the VAE (the real decode still runs)."""
    cpu = torch.device("cpu")
    pipe = load_pipeline(model_dir, torch.float32, cpu, skip=adapter_class.skip_components)
    adapter = adapter_class(pipe, cpu, torch.float32, {})
    engine = DiffusionEngine(
        DiffusionEngineConfig(model=str(model_dir), max_batch_size=max_batch_size), adapter
    )
    engine.final_latents = {}
    decode = adapter.decode

    def keep_and_decode(states):
        engine.final_latents.update({s.request_id: s.latents.clone() for s in states})
        return decode(states)

    adapter.decode = keep_and_decode
    return engine


def run_keeping_last_latents(pipe, *args, **kwargs):
    """diffusers' (final packed latents, PIL images) from one pipeline call: the step callback
    keeps the last step's latents."""
    kept = {}

    def keep(_pipe, _i, _t, tensors):
        kept["latents"] = tensors["latents"]
        return {}

    images = pipe(*args, callback_on_step_end=keep, **kwargs).images
    return kept["latents"], images


def latent_diff(engine, r: GenerationRequest, want: torch.Tensor) -> float:
    """Largest absolute difference of the engine's final latents for `r` from `want`."""
    return float((engine.final_latents[r.request_id] - want).abs().max())


def check_final_latents(engine, results, requests, reference_latents, tolerance, size) -> None:
    """Each request finished without error with its n size x size images, and its final latents
    within `tolerance` (max abs) of `reference_latents(request)`."""
    for r in requests:
        out = results[r.request_id]
        assert out.error is None, out.error
        assert len(out.images) == r.n and out.images[0].size == (size, size)
        assert latent_diff(engine, r, reference_latents(r)) <= tolerance, r.request_id


def check_images(results, requests, reference, tolerance: float = 1.0) -> None:
    """Each request finished without error, with its n images, each within `tolerance` (mean
    absolute pixel difference, 0-255) of the same image of `reference(request)`."""
    for r in requests:
        out = results[r.request_id]
        assert out.error is None, out.error
        assert len(out.images) == r.n, r.request_id
        for got, want in zip(out.images, reference(r), strict=True):
            assert mean_abs_diff(got, want) <= tolerance, r.request_id


def video(frames) -> np.ndarray:
    """PIL frames as one float64 (frames, height, width, 3) array on the 0-255 scale."""
    return np.stack([np.asarray(f.convert("RGB"), dtype=np.float64) for f in frames])


def check_video(got: np.ndarray, want: np.ndarray, rid: str, max_pixel: float, max_mean: float):
    """Frames within `max_pixel` everywhere and `max_mean` on average (0-255 scale)."""
    diff = np.abs(got - want)
    assert diff.max() <= max_pixel and diff.mean() <= max_mean, (rid, diff.max())
