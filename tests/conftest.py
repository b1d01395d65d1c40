"""Shared fixtures: tiny random-weight checkpoints built once per test session."""

from __future__ import annotations

import functools
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
# One OpenMP thread per process, unbound. Tiny models are per-op overhead, and a stage's
# OpenMP threads meet at a barrier after every op: on 2 cores shared by several stage processes
# (or two test workers) a thread descheduled by another process stalls the rest. Measured: two
# served modules side by side took 146 s with vLLM's default binding, 112 s with one thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# A stage's vLLM worker in its engine-core process (vLLM's "uni" executor, what one GPU runs)
# rather than a process of its own: one interpreter, torch and vLLM import fewer per engine.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Secrets the project keeps per user and host (the node link's key, a local Ray cluster's token:
# orchestrator/private_files.py) go to a runtime folder of this test session, never the user's.
os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="omni-test-run-")

# Under pytest-xdist (`make test`: -n 2), tests that start vLLM engines, served pipelines, stage
# processes, Ray or node clusters run one after another in one worker: two such start-ups at once
# would double the memory and make each other's timing bounds meaningless on a 2-core machine.
# Engine-free tests run beside them in the other worker, a module at a time so that its
# module-scoped fixtures are built once. A module runs in the engine worker when any of its tests
# is marked `slow`, when it is listed here (a test whose checks bound wall-clock time belongs
# here too), or when it lies in a folder whose tests start engines (new ones keep arriving
# there). Decided from the module's path and source: the xdist controller schedules by test id,
# without collecting.
REPO_ROOT = Path(__file__).resolve().parents[1]
ENGINE_DIRS = ("tests/multinode/", "tests/ray/", "tests/streaming/")
ENGINE_MODULES = {
    # Engines or servers without a `slow` mark.
    "tests/connectors/test_netns.py",
    "tests/qwen3_omni/test_talker_vllm.py",
    "tests/qwen3_omni/test_thinker_states.py",
    "tests/qwen3_omni/test_thinker_states_preemption.py",
    "tests/serving/test_bench_fair_tiny.py",
    "tests/serving/test_payload_kinds.py",
    "tests/serving/test_step_cache_serve.py",
    "tests/vllm_window/test_serve_modes.py",
    # Engine-free, but their checks bound wall-clock time (a deadline, a wake-up, a lease, a
    # wait), or compare nice values: niced beside the engines, they could be starved of CPU.
    "tests/ar/test_ar_worker_priority.py",
    "tests/connectors/test_nixl.py",
    "tests/connectors/test_shm_inproc.py",
    "tests/qwen3_omni/test_thinker_states_store.py",
    "tests/serving/test_frames.py",
    "tests/test_fair_harness.py",
    "tests/test_parent_watch.py",
}
ENGINE_SCOPE = "engines"
LOWEST_PRIORITY = 19


@functools.cache
def is_engine_module(module: str) -> bool:
    """`module`: a test file's path from the repository root, as in test ids."""
    if module in ENGINE_MODULES or module.startswith(ENGINE_DIRS):
        return True
    path = REPO_ROOT / module
    return path.is_file() and "mark.slow" in path.read_text()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class EngineWorkerScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with every engine module in one scope (one worker, file
        order) and each other module its own scope. The largest scope is handed out first, so
        the engine worker starts at once."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module

    return EngineWorkerScheduling(config, log)


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
