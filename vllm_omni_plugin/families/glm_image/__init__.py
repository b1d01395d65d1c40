"""GLM-Image processing shared by the AR stage and the DiT stage (see families/__init__.py),
and the dotted names of its AR parts, which the pipeline topology and vLLM's model registry
refer to without importing them."""

MODEL_ARCH = "GlmImageForConditionalGeneration"
MODEL_CLASS = "vllm_omni_plugin.models.glm_image.model:GlmImageForConditionalGeneration"
LOGITS_PROCESSOR = "vllm_omni_plugin.models.glm_image.logits:ImageGridLogitsProcessor"
