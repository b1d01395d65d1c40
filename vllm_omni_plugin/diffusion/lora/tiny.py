"""`vllm-omni-plugin make-tiny-lora MODEL_DIR OUT_DIR --rank R --seed S`: a random LoRA adapter
for a checkpoint's transformer, in diffusers' LoRA format (written by the pipeline class's own
`save_lora_weights`, read by its `load_lora_weights`).

It adapts every linear under the family's declared LoRA targets (DiffusionAdapter.lora_targets)
in every transformer the family's adapters adapt (DiffusionAdapter.lora_experts; Wan2.2's
low-noise expert's file goes to the adapter's `transformer_2/` sub-folder) with seeded random
lora_A and lora_B (both non-zero, so the adapter visibly changes the image), stored in bfloat16
(a model of any dtype loads them exactly), and records rank and alpha (alpha = 2 x rank: a
scaling of 2) in diffusers' adapter metadata.
The transformers are built on the meta device from its config: no weights are read, so this works
for full-size checkpoints as well.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


def lora_targets(model_dir: str | Path) -> tuple[str, dict[str, dict[str, tuple[int, int]]]]:
    """(pipeline class, {transformer component: {linear name: (in, out)}}): the linears the
    family's LoRA adapters may adapt, per transformer the checkpoint has (Wan2.2: two)."""
    import diffusers

    from ..adapters.registry import get_adapter_class, pipeline_class_of
    from .layers import _declared

    model_dir = Path(model_dir)
    pipeline = pipeline_class_of(model_dir)
    adapter = get_adapter_class(pipeline)
    prefixes = adapter.lora_targets
    if not prefixes:
        raise ValueError(f"{pipeline} takes no LoRA adapters here")
    index = json.loads((model_dir / "model_index.json").read_text())
    out = {}
    for component in adapter.lora_experts:
        _, cls_name = index.get(component) or (None, None)
        if cls_name is None:  # Wan2.1: no second expert
            continue
        cls = getattr(diffusers, cls_name)
        config = cls.load_config(str(model_dir / component))
        with torch.device("meta"):
            model = cls.from_config(config)
        out[component] = {
            name: (m.in_features, m.out_features)
            for name, m in model.named_modules()
            if type(m) is torch.nn.Linear and _declared(name, prefixes)
        }
    return pipeline, out


def build_tiny_lora(
    model_dir: str | Path, out_dir: str | Path, rank: int = 4, seed: int = 0
) -> Path:
    """The adapter folder: the first transformer's file at its top; a second expert's
    (Wan2.2's `transformer_2`) in its `transformer_2/` sub-folder, drawn after the first's."""
    import diffusers

    if rank < 1:
        raise ValueError(f"--rank must be >= 1, got {rank}")
    pipeline, experts = lora_targets(model_dir)
    gen = torch.Generator("cpu").manual_seed(seed)
    out = Path(out_dir)
    for i, (component, targets) in enumerate(experts.items()):
        layers = {}
        for name, (fan_in, fan_out) in sorted(targets.items()):
            a = torch.randn(rank, fan_in, generator=gen) / math.sqrt(fan_in)
            b = torch.randn(fan_out, rank, generator=gen) * (0.5 / math.sqrt(rank))
            layers[f"{name}.lora_A.weight"] = a.to(torch.bfloat16)
            layers[f"{name}.lora_B.weight"] = b.to(torch.bfloat16)
        folder = out if i == 0 else out / component
        folder.mkdir(parents=True, exist_ok=True)
        getattr(diffusers, pipeline).save_lora_weights(
            str(folder),
            transformer_lora_layers=layers,
            transformer_lora_adapter_metadata={
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": sorted(targets),
            },
        )
    return out
