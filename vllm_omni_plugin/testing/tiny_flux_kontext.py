"""Tiny random-weight FLUX.1-Kontext checkpoint in the hub layout of
`black-forest-labs/FLUX.1-Kontext-dev`.

The same components and sizes as the tiny FLUX.1 checkpoint (tiny_flux.py: CLIP + T5 text
encoders, a guidance-embedded FluxTransformer2DModel, AutoencoderKL, FlowMatchEuler scheduler),
saved by `FluxKontextPipeline.save_pretrained`: model_index.json names that class and lists the
optional IP-adapter components (`image_encoder`, `feature_extractor`) as absent, as on the hub.
"""

from __future__ import annotations

from pathlib import Path

from vllm_omni_plugin.testing import tiny_flux


def build(out_dir: Path, seed: int) -> Path:
    return tiny_flux.build(out_dir, seed, pipeline_class="FluxKontextPipeline")
