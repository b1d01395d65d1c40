"""GLM-Image's AR stage for vLLM: the native model, its position scheme, t2i helpers.

Import the submodules you need; this package stays import-light (no vLLM, no torch kernels)
so `entry_points/general.py` can register the model by its dotted name cheaply.
"""

from vllm_omni_plugin.families.glm_image import LOGITS_PROCESSOR, MODEL_ARCH, MODEL_CLASS

__all__ = ["LOGITS_PROCESSOR", "MODEL_ARCH", "MODEL_CLASS"]
