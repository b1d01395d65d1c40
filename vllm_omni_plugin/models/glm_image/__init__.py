"""GLM-Image's AR stage for vLLM: the native model, its position scheme, t2i helpers.

Import the submodules you need; this package stays import-light (no vLLM, no torch kernels)
so `entry_points/general.py` can register the model by its dotted name cheaply.
"""

MODEL_ARCH = "GlmImageForConditionalGeneration"
MODEL_CLASS = "vllm_omni_plugin.models.glm_image.model:GlmImageForConditionalGeneration"
LOGITS_PROCESSOR = "vllm_omni_plugin.models.glm_image.logits:ImageGridLogitsProcessor"
