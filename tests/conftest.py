"""Shared fixtures: tiny random-weight checkpoints built once per test session."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# vLLM on the CPU: 1 GiB KV cache (the default asks for 0.92 of RAM), no hub access.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
# Secrets the project keeps per user and host (the node link's key, a local Ray cluster's token:
# orchestrator/private_files.py) go to a runtime folder of this test session, never the user's.
os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="omni-test-run-")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """`tiny_models("glm-image")` -> folder of that tiny checkpoint, built once (seed 0)."""
    from vllm_omni_plugin.testing.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = build_tiny_model(kind, root / kind, seed=0)
        return built[kind]

    return get


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module: tiny models are per-op overhead, and two OpenMP threads
    on the shared 2-core box spend more time waiting on each other than computing (20x measured
    on the GLM-Image AR, tests/test_tiny_models.py)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
