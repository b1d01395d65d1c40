"""Real `vllm serve` processes for the serving tests (module-scoped: few start-ups)."""

from __future__ import annotations

import json

import pytest
from omni_server import (
    API_KEY,
    OTHER_KEY,
    QWEN_MAX_BATCH,
    QWEN_MAX_QUEUED,
    REPO,
    REQUEST_TIMEOUT_S,
    Server,
)


@pytest.fixture(scope="module")
def qwen_server(tiny_models, tmp_path_factory):
    model = tiny_models("qwen-image")
    root = tmp_path_factory.mktemp("qwen-server")
    # The bundled CPU config plus a short serving.request_timeout_s, which one test exceeds,
    # and small bounds a burst can exceed: 2 requests run (max_batch_size), 2 more may wait.
    config = root / "qwen_image_tiny_timeout.yaml"
    config.write_text(
        f"base_config: {REPO / 'stage_configs' / 'qwen_image_tiny.yaml'}\n"
        f"serving:\n  request_timeout_s: {REQUEST_TIMEOUT_S}\n"
        f"  max_queued_requests: {QWEN_MAX_QUEUED}\n"
        f"stages:\n  - stage_id: 0\n    max_batch_size: {QWEN_MAX_BATCH}\n"
    )
    server = Server(
        [str(model), "--stage-config", str(config), "--api-key", API_KEY, OTHER_KEY],
        root / "server.log",
    )
    try:
        server.startup_s = server.wait_healthy()
        server.model = str(model)
        yield server
    finally:
        server.stop()


# ---- Shared by test_fuzz.py, test_soak.py, test_stream_disconnect.py and
# test_glm_edits_serve.py ---
# Session scope: two start-ups serve all three modules. Both expose the live stage-inspection
# route (VLLM_OMNI_DESCRIBE_STAGES=1), which the tests read stage-side counters from.
SHARED_ENV = {"VLLM_OMNI_DESCRIBE_STAGES": "1"}
# Qwen-Image with small limits, so whatever valid request the fuzzer finds costs little:
# up to 128x128, 4 steps, 2 images (the rest gets a 400 before any stage).
GREEDY_GLM_OVERRIDES = '{"0": {"default_sampling_params": {"temperature": 0.0}}}'
# test_soak.py runs 64 clients at once against both shared servers: all are admitted.
SOAK_QUEUE = 64
# The served Qwen3-Omni tests compare with transformers' greedy generate (no repetition
# penalty: testing/qwen3_omni_reference.py): the talker greedy, without the checkpoint's 1.05.
OMNI_GREEDY_TALKER = (
    '{"1": {"default_sampling_params": {"temperature": 0, "repetition_penalty": 1.0}}}'
)
# Step caching enabled (test_step_cache_serve.py); requests without `cache` run as without it.
SMALL_QWEN_OVERRIDES = (
    '{"0": {"max_height": 128, "max_width": 128, "max_num_inference_steps": 4, '
    '"step_cache": {"policies": ["first_block", "teacache", "taylorseer"], "max_threshold": 6}}}'
)


def start_shared(model, config, root, *extra: str, env: dict[str, str] | None = None) -> Server:
    server = Server(
        [str(model), "--stage-config", str(config), "--api-key", API_KEY, *extra],
        root / "server.log",
        env={**SHARED_ENV, **(env or {})},
    )
    try:
        server.startup_s = server.wait_healthy(timeout=600)
    except BaseException:
        server.stop()
        raise
    server.model = str(model)
    return server


@pytest.fixture(scope="session")
def small_qwen_server(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("small-qwen-server")
    config = root / "qwen_image_small.yaml"
    config.write_text(
        f"base_config: {REPO / 'stage_configs' / 'qwen_image_tiny.yaml'}\nserving:\n  max_n: 2\n"
        f"  max_queued_requests: {SOAK_QUEUE}\n"
    )
    server = start_shared(
        tiny_models("qwen-image"), config, root, "--stage-overrides", SMALL_QWEN_OVERRIDES
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def shared_glm_server(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-glm-server")
    config = root / "glm_image_tiny_soak.yaml"
    config.write_text(
        f"base_config: {REPO / 'stage_configs' / 'glm_image_tiny.yaml'}\n"
        f"serving:\n  max_queued_requests: {SOAK_QUEUE}\n"
    )
    # The AR stage greedy, so that test_glm_edits_serve.py can compare served images with
    # transformers' greedy AR + diffusers' DiT (sampling in vLLM and transformers differs).
    server = start_shared(
        tiny_models("glm-image"), config, root, "--stage-overrides", GREEDY_GLM_OVERRIDES
    )
    try:
        yield server
    finally:
        server.stop()


# ---- Shared by test_request_fields_serve.py: an edit family and a video family ---
@pytest.fixture(scope="session")
def shared_edit_server(tiny_models, tmp_path_factory):
    """Qwen-Image-Edit, the bundled CPU config; also serves LoRA adapters (test_lora_serve.py):
    two tiny ones in `server.lora_dir`, set with --stage-overrides, runtime loading on."""
    from vllm_omni_plugin.diffusion.lora.tiny import build_tiny_lora

    root = tmp_path_factory.mktemp("shared-edit-server")
    model = tiny_models("qwen-image-edit")
    lora_dir = root / "loras"
    build_tiny_lora(model, lora_dir / "style", rank=4, seed=1)
    build_tiny_lora(model, lora_dir / "detail", rank=8, seed=2)
    lora = {"dir": str(lora_dir), "max_loaded": 2, "max_rank": 8}
    server = start_shared(
        model,
        REPO / "stage_configs" / "qwen_image_edit_tiny.yaml",
        root,
        "--stage-overrides",
        json.dumps({"0": {"lora": lora}}),
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )
    server.lora_dir = lora_dir
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def shared_wan_server(tiny_models, tmp_path_factory):
    """Wan2.2 (two experts), the bundled CPU config with its job store in a temporary folder;
    one tiny LoRA adapter (both experts' files) in its lora.dir `server.lora_dir`
    (test_lora_serve.py)."""
    from vllm_omni_plugin.diffusion.lora.tiny import build_tiny_lora

    root = tmp_path_factory.mktemp("shared-wan-server")
    config = root / "wan_tiny_store.yaml"
    build_tiny_lora(tiny_models("wan"), root / "loras" / "motion", rank=4, seed=1)
    config.write_text(
        f"base_config: {REPO / 'stage_configs' / 'wan_tiny.yaml'}\n"
        f"videos:\n  store_dir: {root / 'store'}\n"
        f"stages:\n  - stage_id: 0\n    lora:\n      dir: {root / 'loras'}\n"
    )
    server = start_shared(tiny_models("wan"), config, root)
    server.lora_dir = root / "loras"
    try:
        yield server
    finally:
        server.stop()


# ---- The edit families (test_edit_families_serve.py): one server each ----------
@pytest.fixture(scope="module")
def kontext_server(tiny_models, tmp_path_factory):
    """FLUX.1-Kontext, the bundled CPU config."""
    root = tmp_path_factory.mktemp("kontext-server")
    config = REPO / "stage_configs" / "flux_kontext_tiny.yaml"
    server = start_shared(tiny_models("flux-kontext"), config, root)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def edit_plus_server(tiny_models, tmp_path_factory):
    """Qwen-Image-Edit-2509, the bundled CPU config."""
    root = tmp_path_factory.mktemp("edit-plus-server")
    config = REPO / "stage_configs" / "qwen_image_edit_plus_tiny.yaml"
    server = start_shared(tiny_models("qwen-image-edit-plus"), config, root)
    try:
        yield server
    finally:
        server.stop()


def _wan_image_server(tiny_models, tmp_path_factory, kind: str, config_name: str, *extra):
    root = tmp_path_factory.mktemp(f"shared-{kind}-server")
    config = root / f"{kind}_store.yaml"
    config.write_text(
        f"base_config: {REPO / 'stage_configs' / config_name}\n"
        f"videos:\n  store_dir: {root / 'store'}\n"
    )
    return start_shared(tiny_models(kind), config, root, *extra)


# A memory budget (the tiny weights are a few MB) that a 32x32 clip fits a few times over and
# a long 256x256 one does not: test_videos_i2v.py's memory-planning test.
WAN_I2V_MEMORY_GB = 0.1


# ---- Wan2.2 image-to-video: test_videos_i2v.py ----
@pytest.fixture(scope="module")
def shared_wan_i2v_server(tiny_models, tmp_path_factory):
    """Wan2.2 I2V-A14B (two experts), the bundled CPU config, its store in a temporary folder,
    and a memory budget (WAN_I2V_MEMORY_GB)."""
    overrides = f'{{"0": {{"memory_budget_gb": {WAN_I2V_MEMORY_GB}}}}}'
    server = _wan_image_server(
        tiny_models,
        tmp_path_factory,
        "wan-i2v",
        "wan_i2v_tiny.yaml",
        "--stage-overrides",
        overrides,
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def shared_wan_ti2v_server(tiny_models, tmp_path_factory):
    """Wan2.2 TI2V-5B (text or image to video), the bundled CPU config."""
    server = _wan_image_server(tiny_models, tmp_path_factory, "wan-ti2v", "wan_ti2v_tiny.yaml")
    try:
        yield server
    finally:
        server.stop()


# ---- A pipeline with a chat stage next to stock `vllm serve` of the same model ----
HERE = REPO / "tests" / "serving"
# A byte-level chat template for the tiny Qwen2 (it has none of its own).
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# 4096 positions: room for a stream long enough (seconds on the CPU) that a hang-up test's
# client reacts well before the engine could finish it.
CHAT_MAX_MODEL_LEN = 4096
CHAT_SERVE_ARGS = [
    "--enforce-eager",
    "--max-model-len",
    str(CHAT_MAX_MODEL_LEN),
    "--dtype",
    "float32",
]


def _tiny_chat_model(root):
    import json

    from tiny_text_model import build_tiny_text_model

    model = build_tiny_text_model(root / "tiny-qwen2-chat", max_positions=CHAT_MAX_MODEL_LEN)
    path = model / "tokenizer_config.json"
    path.write_text(
        json.dumps({**json.loads(path.read_text()), "chat_template": TINY_CHAT_TEMPLATE})
    )
    return model


def _pipeline_dist(root):
    """Distribution metadata naming the test pipeline in `vllm_omni_plugin.pipelines`, on a
    PYTHONPATH entry next to its module: how a third-party pipeline package registers."""
    import shutil

    site = root / "site"
    info = site / "omni_test_chat-0.0.dist-info"
    info.mkdir(parents=True)
    shutil.copy(HERE / "chat_pipeline" / "omni_test_chat.py", site / "omni_test_chat.py")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: omni-test-chat\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm_omni_plugin.pipelines]\ntest_text_chat = omni_test_chat:TEXT_CHAT\n"
    )
    return site


@pytest.fixture(scope="module")
def chat_servers(tmp_path_factory):
    """(pipeline server, stock server): the test chat pipeline (omni_test_chat.py) and stock
    `vllm serve` of the same tiny model, started together."""
    import os

    root = tmp_path_factory.mktemp("chat-servers")
    model = _tiny_chat_model(root)
    site = _pipeline_dist(root)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    ours = Server(
        [
            str(model),
            "--stage-config",
            str(HERE / "chat_pipeline" / "text_chat_tiny.yaml"),
            "--api-key",
            API_KEY,
        ],
        root / "ours.log",
        env={**SHARED_ENV, "PYTHONPATH": path},
    )
    stock = Server([str(model), *CHAT_SERVE_ARGS, "--api-key", API_KEY], root / "stock.log")
    try:
        for server in (ours, stock):
            server.startup_s = server.wait_healthy(timeout=600)
            server.model = str(model)
        yield ours, stock
    finally:
        ours.stop()
        stock.stop()


# ---- Qwen3-Omni: thinker (vLLM) -> talker -> Code2Wav on the tiny checkpoint ----
@pytest.fixture(scope="module")
def omni_speech_server(tiny_models, tmp_path_factory):
    """The bundled CPU config, its talker made greedy (at most 64 frames per request); the
    media parts of a chat may name http(s) URLs on 127.0.0.1 (serving.edit_url_hosts) and
    file: URLs within `server.media_folder` (the chat stage's allowed_local_media_path)."""
    root = tmp_path_factory.mktemp("omni-speech-server")
    media_folder = root / "media"
    media_folder.mkdir()
    config = root / "qwen3_omni_tiny_media_urls.yaml"
    config.write_text(
        f"base_config: {REPO / 'stage_configs' / 'qwen3_omni_tiny.yaml'}\n"
        "serving:\n  edit_url_hosts: [127.0.0.1]\n"
        f"stages:\n  - stage_id: 0\n    allowed_local_media_path: {media_folder}\n"
    )
    server = start_shared(
        tiny_models("qwen3-omni"),
        config,
        root,
        "--stage-overrides",
        OMNI_GREEDY_TALKER,
    )
    server.media_folder = media_folder
    try:
        yield server
    finally:
        server.stop()


# ---- Shared by test_t2i_families_serve.py: Z-Image-Turbo and FLUX.2 klein ----
@pytest.fixture(scope="module")
def z_image_server(tiny_models, tmp_path_factory):
    """Z-Image-Turbo through `--stage-config auto` (model_index.json -> z_image_tiny.yaml)."""
    root = tmp_path_factory.mktemp("z-image-server")
    server = start_shared(tiny_models("z-image"), "auto", root)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def flux2_klein_server(tiny_models, tmp_path_factory):
    """FLUX.2 klein, the bundled CPU config (text to image and edits)."""
    root = tmp_path_factory.mktemp("flux2-klein-server")
    server = start_shared(
        tiny_models("flux2-klein"), REPO / "stage_configs" / "flux2_klein_tiny.yaml", root
    )
    try:
        yield server
    finally:
        server.stop()
