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

# Under pytest-xdist (`make test`: -n 2 --dist loadgroup), tests that start vLLM engines, served
# pipelines, stage processes, Ray or node clusters run one after another in one worker: two such
# start-ups at once would double the memory and make each other's timing bounds meaningless on a
# 2-core machine. Engine-free tests run beside them in the other worker, a module at a time so
# that its module-scoped fixtures are built once. Whole folders whose tests start engines (and
# where new ones keep arriving) count as engine tests; so does anything marked `slow`.
ENGINE_DIRS = ("tests/multinode/", "tests/ray/", "tests/streaming/")
ENGINE_MODULES = {
    "tests/connectors/test_netns.py",
    "tests/qwen3_omni/test_talker_vllm.py",
    "tests/qwen3_omni/test_thinker_states.py",
    "tests/qwen3_omni/test_thinker_states_preemption.py",
    "tests/serving/test_bench_fair_tiny.py",
    "tests/serving/test_payload_kinds.py",
    "tests/serving/test_step_cache_serve.py",
    "tests/vllm_window/test_serve_modes.py",
}
ENGINE_GROUP = "engines"
IN_ENGINE_GROUP = pytest.StashKey[bool]()


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def starts_engines(item: pytest.Item) -> bool:
    module = module_of(item)
    return (
        item.get_closest_marker("slow") is not None
        or module in ENGINE_MODULES
        or module.startswith(ENGINE_DIRS)
    )


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups
def pytest_collection_modifyitems(config, items):
    # A module with one engine test goes to the engine worker whole: split between the two
    # workers, its module-scoped fixtures (an engine, a server) would be built twice.
    engine_modules = {module_of(item) for item in items if starts_engines(item)}
    for item in items:
        module = module_of(item)
        group = ENGINE_GROUP if module in engine_modules else module
        item.add_marker(pytest.mark.xdist_group(group))
        item.stash[IN_ENGINE_GROUP] = module in engine_modules


@pytest.fixture(autouse=True)
def engine_free_on_one_torch_thread(request):
    """Beside the engine worker, an engine-free test's torch runs on one thread: the two
    workers already fill both cores, and OpenMP threads that outnumber the free cores spin
    waiting on each other (see one_torch_thread)."""
    if "PYTEST_XDIST_WORKER" not in os.environ or request.node.stash.get(IN_ENGINE_GROUP, True):
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
