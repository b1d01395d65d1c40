"""`--stage-config auto`: the bundled deploy file of the model's own pipeline class.

The model's model_index.json `_class_name` picks the family; the platform picks the file: on a
GPU the family's one-GPU full-size file, elsewhere its CPU file (fp32, small defaults: the
files the tiny checkpoints are served with). A class without a bundled file is refused with
the list of the supported ones (the generic whole-pipeline fallback is never picked silently).
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_omni_plugin.config.errors import ConfigError, ConfigProblem

AUTO = "auto"

# model_index.json `_class_name` -> (one-GPU full-size deploy file, CPU deploy file), by name
# in stage_configs/.
AUTO_CONFIGS: dict[str, tuple[str, str]] = {
    "GlmImagePipeline": ("glm_image_1gpu", "glm_image_tiny"),
    "QwenImagePipeline": ("qwen_image", "qwen_image_tiny"),
    "QwenImageEditPipeline": ("qwen_image_edit", "qwen_image_edit_tiny"),
    "FluxPipeline": ("flux", "flux_tiny"),
    "FluxKontextPipeline": ("flux_kontext", "flux_kontext_tiny"),
    "QwenImageEditPlusPipeline": ("qwen_image_edit_plus", "qwen_image_edit_plus_tiny"),
    "WanPipeline": ("wan2_2", "wan_tiny"),
    "WanImageToVideoPipeline": ("wan2_2_i2v", "wan_i2v_tiny"),
    "ZImagePipeline": ("z_image", "z_image_tiny"),
    "Flux2KleinPipeline": ("flux2_klein", "flux2_klein_tiny"),
}
# Checkpoints of one class that another file serves, told apart by a model_index.json flag
# that is true: (class, flag) -> files. Wan2.2 TI2V-5B is a WanPipeline with expand_timesteps.
AUTO_VARIANTS: dict[tuple[str, str], tuple[str, str]] = {
    ("WanPipeline", "expand_timesteps"): ("wan2_2_ti2v", "wan_ti2v_tiny"),
}
GPU_PLATFORMS = ("cuda", "rocm")


def _problem(field: str, message: str) -> ConfigError:
    return ConfigError([ConfigProblem(f"--stage-config {AUTO}", None, field, message)])


def model_class(model: str) -> str:
    """`_class_name` of the model's model_index.json: a local folder's, else the hub's (through
    huggingface_hub's cache; HF_HUB_OFFLINE is honoured). ConfigError when there is none."""
    return model_index(model)["_class_name"]


def model_index(model: str) -> dict:
    """The model's model_index.json (as `model_class` finds it), with a `_class_name`."""
    local = Path(model).expanduser()
    if local.is_dir():
        index = local / "model_index.json"
        if not index.is_file():
            raise _problem("model", f"{model} has no model_index.json (not a diffusers pipeline)")
    else:
        try:
            from huggingface_hub import hf_hub_download

            index = Path(hf_hub_download(model, "model_index.json"))
        except Exception as exc:  # offline, unknown repo, no such file: all say the same
            raise _problem(
                "model", f"cannot read model_index.json of {model}: {type(exc).__name__}: {exc}"
            ) from None
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise _problem("model", f"cannot read {index}: {exc}") from None
    name = data.get("_class_name") if isinstance(data, dict) else None
    if not isinstance(name, str) or not name:
        raise _problem("model", f"{index} names no _class_name")
    return data


def auto_config_name(model: str | None, platform: str) -> str:
    """The bundled deploy file (its name in stage_configs/) for `model` on `platform`."""
    if not model:
        raise _problem("model", "auto picks the deploy file from the model: pass MODEL")
    index = model_index(model)
    name = index["_class_name"]
    if name not in AUTO_CONFIGS:
        supported = ", ".join(sorted(AUTO_CONFIGS))
        raise _problem(
            "model",
            f"no bundled deploy file serves pipeline class {name} (model_index.json of "
            f"{model}); --stage-config auto supports: {supported}",
        )
    gpu, cpu = AUTO_CONFIGS[name]
    for (cls, flag), files in AUTO_VARIANTS.items():
        if cls == name and index.get(flag) is True:
            gpu, cpu = files
    return gpu if platform in GPU_PLATFORMS else cpu
