"""Shared fixtures: tiny random-weight checkpoints built once per test session."""

from __future__ import annotations

import atexit
import os
import shutil
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
# orchestrator/private_files.py) and the AR stage's tokenizer folders (stages/tokenizer_folder.py)
# go to a runtime folder of this test session, never the user's; removed when the session ends.
os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="omni-test-run-")
atexit.register(shutil.rmtree, os.environ["XDG_RUNTIME_DIR"], ignore_errors=True)
# vLLM names its engines' ZMQ ipc sockets in the temp folder and leaves them there when the
# engine's process is killed (a stopped `vllm serve` leaves three): they go with the session.
os.environ["VLLM_RPC_BASE_PATH"] = os.environ["XDG_RUNTIME_DIR"]
# What torch.compile caches (tests that compile the talker's code predictor) and vLLM's own
# cache (its AOT-compiled graphs, model-class inspections) stay in the session too, not the
# user's ~/.cache: a cache left by another run never decides a result. The session's xdist
# workers share one such folder, made by the controller before it starts them (they inherit its
# environment): vLLM inspects a model class it has not cached in a subprocess of its own (~8
# CPU-s), which then runs once per class in the session rather than once per class and worker.
SHARED_CACHE_ENV = "OMNI_TEST_SESSION_CACHE"
if not (os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(SHARED_CACHE_ENV)):
    os.environ[SHARED_CACHE_ENV] = tempfile.mkdtemp(prefix="omni-test-cache-")
    atexit.register(shutil.rmtree, os.environ[SHARED_CACHE_ENV], ignore_errors=True)
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(os.environ[SHARED_CACHE_ENV], "inductor")
os.environ["VLLM_CACHE_ROOT"] = os.path.join(os.environ[SHARED_CACHE_ENV], "vllm-cache")

# Under pytest-xdist (`make test`: -n 2) each module is a unit of work (its module-scoped
# servers start once), except that the Ray modules are one unit: one Ray cluster at a time.
# The units longest to run are handed out first, so that none starts last beside an idle
# worker. Seconds measured on the 2-core machine; only their order matters, and a unit not
# listed runs after these, in file order.
RAY_UNIT = "tests/ray/"
# The modules that use the session servers of tests/serving/conftest.py (GLM-Image, the small
# Qwen-Image, Qwen-Image-Edit, Wan) are one unit too: each worker starts its own copy of a
# session server when one of its modules first asks for it, so on one worker each starts once.
SESSION_SERVERS_UNIT = "tests/serving/ (session servers)"
UNIT_OF = {
    f"tests/serving/{module}.py": SESSION_SERVERS_UNIT
    for module in (
        "test_request_fields_serve",
        "test_lora_serve",
        "test_edits_serve",
        "test_glm_nixl_serve",
        "test_glm_edits_serve",
        "test_bench_ar_served_tiny",
        "test_soak",
        "test_stream_disconnect",
        "test_fuzz",
        "test_step_cache_serve",
    )
}
LONGEST_UNITS = {
    SESSION_SERVERS_UNIT: 333,
    RAY_UNIT: 267,
    "tests/serving/test_shutdown_serve.py": 113,
    "tests/multinode/test_qwen3_omni_nodes.py": 102,
    "tests/serving/test_glm_serve.py": 80,
    "tests/multinode/test_headless_loopback.py": 78,
    "tests/serving/test_chat_stage_serve.py": 69,
    "tests/ar/test_ar_engine.py": 65,
    "tests/serving/test_qwen3_omni_serve.py": 52,
    "tests/serving/test_watchdog.py": 49,
    "tests/diffusion/test_compile_cache.py": 44,
    "tests/test_full_glm_image.py": 33,
    "tests/test_full_qwen_flux.py": 31,
    "tests/test_full_wan.py": 41,
    "tests/qwen3_omni/test_thinker_states_preemption.py": 40,
    "tests/serving/test_videos.py": 40,
    "tests/serving/test_edit_families_serve.py": 39,
    "tests/diffusion/test_parallel_serve.py": 38,
    "tests/qwen3_omni/test_talker_async.py": 37,
    "tests/streaming/test_streamed_edges.py": 35,
    "tests/serving/test_plain_serve.py": 31,
    "tests/multinode/test_headless_netns.py": 30,
    "tests/serving/test_videos_i2v.py": 30,
    "tests/vllm_window/test_seams.py": 21,
}


def work_unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return RAY_UNIT if module.startswith(RAY_UNIT) else UNIT_OF.get(module, module)


def pytest_collection_modifyitems(config, items):
    if "PYTEST_XDIST_WORKER" in os.environ:
        items.sort(key=lambda item: -LONGEST_UNITS.get(work_unit(item.nodeid), 0))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # the collection's order (above), not test counts
    return UnitScheduling(config, log)


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


@pytest.fixture(scope="module")
def async_on_cpu():
    """Keeps `async_scheduling` as the engine arguments ask: vLLM's CPU platform turns it off
    in `check_and_update_config`. The engine's config is final where `LLM` builds it, in this
    process; its engine core and worker processes (vLLM's multiprocess executor: its
    single-process one does not schedule asynchronously) receive it as built, so patching this
    process is enough."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def keep_async(cls, vllm_config):
        wanted = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = wanted

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CpuPlatform, "check_and_update_config", classmethod(keep_async))
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        yield


@pytest.fixture
def ram_dir(tmp_path):
    """A temporary folder in memory (/dev/shm where it exists, else `tmp_path`), for tests that
    write gigabytes and read them back once: nothing of theirs waits on disk writeback behind
    what the other worker's tests write."""
    import shutil

    shm = Path("/dev/shm")
    if not shm.is_dir():
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix="omni-test-", dir=shm))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def qwen3_omni_local_answers(tiny_models, tmp_path_factory):
    """The local Qwen3-Omni pipeline's answers that the multi-host speech tests compare with
    (tests/speech_reference.py): one server start per test run, since under xdist the workers'
    temp folders share a parent, where the first worker to ask leaves them for the other."""
    from speech_reference import local_answers

    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent
    log = tmp_path_factory.mktemp("qwen3-omni-local") / "server.log"
    return local_answers(tiny_models("qwen3-omni"), shared, log)
