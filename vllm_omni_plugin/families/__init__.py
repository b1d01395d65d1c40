"""What the engines of one model family share, below both of them.

GLM-Image's prompt layout, grid arithmetic, source-image processing and vision tokenizer are
used by its AR model (models/glm_image, on vLLM) and by its DiT adapter (diffusion/adapters):
they live here, so neither engine imports the other. Nothing here imports vLLM.
"""
