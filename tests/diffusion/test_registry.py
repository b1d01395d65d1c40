"""Adapter registry: built-in families, aliases, the entry-point group, the generic fallback."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.adapters import ENTRY_POINT_GROUP, get_adapter_class
from vllm_omni_plugin.diffusion.adapters.flux import FluxAdapter
from vllm_omni_plugin.diffusion.adapters.generic import GenericAdapter
from vllm_omni_plugin.diffusion.adapters.glm_image import GlmImageAdapter
from vllm_omni_plugin.diffusion.adapters.qwen_image import QwenImageAdapter


def test_builtin_names_and_aliases():
    assert get_adapter_class("GlmImagePipeline") is GlmImageAdapter
    assert get_adapter_class("GlmImageForConditionalGeneration") is GlmImageAdapter
    assert get_adapter_class("QwenImagePipeline") is QwenImageAdapter
    assert get_adapter_class("FluxPipeline") is FluxAdapter
    assert get_adapter_class("StableDiffusion3Pipeline") is GenericAdapter


def test_entry_point_group_extends_registry(tmp_path):
    (tmp_path / "my_adapters.py").write_text(
        "from vllm_omni_plugin.diffusion.adapters.generic import GenericAdapter\n"
        "class MyAdapter(GenericAdapter):\n    pass\n"
    )
    dist = tmp_path / "my_adapters-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-adapters\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nMyPipeline = my_adapters:MyAdapter\n"
    )
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from vllm_omni_plugin.diffusion.adapters import get_adapter_class, registered_adapters
        cls = get_adapter_class("MyPipeline")
        assert cls.__module__ == "my_adapters" and cls.__name__ == "MyAdapter", cls
        assert "MyPipeline" in registered_adapters()
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"


def test_generic_fallback_runs_whole_pipeline(tiny_models, pixel_diff):
    from diffusers import FluxPipeline

    model = str(tiny_models("flux"))
    # An unknown class name forces the whole-pipeline fallback on a FLUX checkpoint.
    engine = DiffusionEngine(DiffusionEngineConfig(model=model, pipeline_class="SomeNewPipeline"))
    assert isinstance(engine.adapter, GenericAdapter)
    reqs = [
        GenerationRequest(f"g{i}", p, height=64, width=64, num_inference_steps=2, seed=i)
        for i, p in enumerate(["a cat", "a red cube"])
    ]
    outs = engine.generate(reqs)
    pipe = FluxPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    for r, out in zip(reqs, outs, strict=True):
        assert out.error is None
        assert engine.progress(r.request_id) == (2, 2)
        want = pipe(
            r.prompt,
            height=64,
            width=64,
            num_inference_steps=2,
            guidance_scale=3.5,
            generator=torch.Generator("cpu").manual_seed(r.seed),
        ).images[0]
        assert pixel_diff(out.images[0], want) <= 1.0
