"""Bundled deploy configs (`--stage-config glm_image` resolves here)."""
