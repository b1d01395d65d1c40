"""The tiny Qwen3-Omni checkpoint and its transformers reference, built once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def omni_dir(tiny_models):
    return tiny_models("qwen3-omni")


@pytest.fixture(scope="session")
def omni_model(omni_dir):
    from vllm_omni_plugin.testing.qwen3_omni_reference import load_reference_model

    return load_reference_model(omni_dir)
