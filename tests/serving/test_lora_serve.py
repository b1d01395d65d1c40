"""LoRA adapters per request on a served model, through the official `openai` client: the
session's Qwen-Image-Edit server (conftest's shared_edit_server) with two tiny adapters under
its `lora.dir` (set by --stage-overrides) and VLLM_ALLOW_RUNTIME_LORA_UPDATING on.

Concurrent edits with two adapters (and none) share the stage's forwards; each gets its own
adapter: the images differ from the plain one and each equals the same request sent alone
(mean abs pixel difference <= 1.0 on the 0-255 scale, the engine's batching tolerance).
/v1/models lists the adapters; vLLM's runtime routes load and unload them; bad adapters are
4xx in OpenAI's error shape and nothing is loaded.
"""

from __future__ import annotations

import base64
import io
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from omni_server import API_KEY
from openai import BadRequestError, NotFoundError, OpenAI
from PIL import Image

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
TIMEOUT = 180


def source_png() -> bytes:
    rng = np.random.default_rng(0)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=float)


def edit(server, lora=None, seed: int = 5) -> np.ndarray:
    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT)
    extra = {"seed": seed, "num_inference_steps": 2}
    if lora is not None:
        extra["lora"] = lora
    res = client.images.edit(
        image=("source.png", source_png(), "image/png"),
        prompt="make it red",
        size="64x64",
        extra_body=extra,
    )
    return pixels(res.data[0].b64_json)


def models(server) -> dict[str, dict]:
    data = httpx.get(f"{server.url}/v1/models", headers=HEADERS, timeout=30).json()["data"]
    return {card["id"]: card for card in data}


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body, headers=HEADERS, timeout=30)


def test_two_adapters_in_concurrent_requests(shared_edit_server):
    server = shared_edit_server
    loras = [
        None,
        [{"name": "style", "scale": 1.0}],
        [{"name": "detail", "scale": 0.8}, {"name": "style", "scale": -0.5}],
    ]
    with ThreadPoolExecutor(len(loras)) as pool:
        together = list(pool.map(lambda lora: edit(server, lora), loras))
    plain = together[0]
    for lora, got in zip(loras[1:], together[1:], strict=True):
        assert np.abs(got - plain).mean() > 1.0, lora  # the adapter shows
    assert np.abs(together[1] - together[2]).mean() > 1.0
    # Two adapters with their own scales in one request: as when sent alone.
    assert np.abs(together[2] - edit(server, loras[2])).mean() <= 1.0


def test_video_job_with_an_adapter(shared_wan_server):
    """/v1/videos through the official client (a multipart form): the job with the adapter
    completes with other frames than the same job without it; an unknown adapter is a 404."""
    c = OpenAI(
        base_url=f"{shared_wan_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT
    )
    extra = {"num_frames": 5, "num_inference_steps": 2, "seed": 3}
    plain = c.videos.create_and_poll(prompt="a cat", size="32x32", extra_body=extra)
    styled = c.videos.create_and_poll(
        prompt="a cat",
        size="32x32",
        extra_body={**extra, "lora": [{"name": "motion", "scale": 1.5}]},
    )
    assert plain.status == styled.status == "completed"
    content = {v.id: c.videos.download_content(v.id).read() for v in (plain, styled)}
    assert content[plain.id] != content[styled.id]
    with pytest.raises(NotFoundError) as info:
        c.videos.create(prompt="a cat", extra_body={**extra, "lora": [{"name": "missing"}]})
    assert info.value.body["param"] == "lora[0].name"


def test_video_second_expert_file_is_checked_before_the_stage(shared_wan_server, tiny_models):
    """Wan2.2's low-noise expert's file (an adapter's transformer_2/) is checked by the API
    server against that expert: another family's file there is a 400 naming it, not listed."""
    from vllm_omni_plugin.diffusion.lora.tiny import build_tiny_lora

    root = shared_wan_server.lora_dir
    assert (root / "motion" / "transformer_2" / "pytorch_lora_weights.safetensors").is_file()
    build_tiny_lora(tiny_models("wan"), root / "wrong-low", rank=4, seed=2)
    shutil.rmtree(root / "wrong-low" / "transformer_2")
    build_tiny_lora(tiny_models("flux"), root / "wrong-low" / "transformer_2", rank=4, seed=2)
    try:
        cards = models(shared_wan_server)
        assert "motion" in cards and "wrong-low" not in cards
        c = OpenAI(
            base_url=f"{shared_wan_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60
        )
        with pytest.raises(BadRequestError) as info:
            c.videos.create(prompt="a cat", extra_body={"lora": [{"name": "wrong-low"}]})
        assert (
            "adapter 'wrong-low' (transformer_2) does not fit Wan2.2"
            in (info.value.body["message"])
        )
        assert info.value.body["param"] == "lora[0]"
    finally:
        shutil.rmtree(root / "wrong-low")


def test_models_list_adapters_and_runtime_load_unload(shared_edit_server):
    server = shared_edit_server
    cards = models(server)
    assert {"style", "detail"} <= set(cards)
    assert cards["style"]["parent"] == server.model
    res = post(server, "load_lora_adapter", {"lora_name": "copy", "lora_path": "style"})
    assert res.status_code == 200, res.text
    assert "copy" in models(server)
    edit(server, [{"name": "copy"}])  # served under its new name
    assert post(server, "unload_lora_adapter", {"lora_name": "copy"}).status_code == 200
    assert "copy" not in models(server)
    with pytest.raises(NotFoundError) as info:
        edit(server, [{"name": "copy"}])
    assert info.value.body["param"] == "lora[0].name"
    res = post(server, "unload_lora_adapter", {"lora_name": "copy"})
    assert res.status_code == 404 and "error" in res.json()


def test_bad_adapters_are_4xx_and_nothing_loads(shared_edit_server, tiny_models, tmp_path):
    from vllm_omni_plugin.diffusion.lora.tiny import build_tiny_lora

    server = shared_edit_server
    root = server.lora_dir
    build_tiny_lora(tiny_models("qwen-image-edit"), root / "big", rank=16, seed=3)  # > max_rank 8
    build_tiny_lora(tiny_models("flux"), root / "flux-style", rank=4, seed=4)  # another family
    (root / "broken").mkdir(exist_ok=True)
    (root / "broken" / "pytorch_lora_weights.safetensors").write_bytes(b"\x08\x00\x00\x00garbage!")
    outside = tmp_path / "outside"
    shutil.copytree(root / "style", outside)
    before = set(models(server))
    assert not {"big", "flux-style", "broken"} & before  # listed only when they fit
    for name, message in (
        ("big", "above lora.max_rank=8"),
        ("flux-style", "does not fit Qwen-Image-Edit"),
        ("broken", "not a readable safetensors file"),
    ):
        with pytest.raises(BadRequestError) as info:
            edit(server, [{"name": name}])
        assert message in info.value.body["message"], info.value.body
        res = post(server, "load_lora_adapter", {"lora_name": f"x-{name}", "lora_path": name})
        assert res.status_code == 400 and message in res.json()["error"]["message"], res.text
    res = post(server, "load_lora_adapter", {"lora_name": "out", "lora_path": str(outside)})
    assert res.status_code == 400 and "outside the adapter directory" in res.text
    with pytest.raises(NotFoundError):
        edit(server, [{"name": "missing"}])
    with pytest.raises(BadRequestError) as info:
        edit(server, [{"name": "style", "scale": "strong"}])
    assert info.value.body["param"] == "lora[0].scale"
    assert set(models(server)) == before
    for name in ("big", "flux-style", "broken"):
        shutil.rmtree(root / name)


def test_form_adapters_without_a_scale_each_are_refused(shared_edit_server, shared_wan_server):
    """The openai client writes `extra_body={"lora": [...]}` in a multipart form as every
    lora[][name], then every lora[][scale]: with a scale on only some adapters the pairing is
    lost, so the edit (and the video job) is a 400 naming `lora` in OpenAI's shape, never run
    with the scales on the wrong adapters."""
    mixed = [{"name": "style"}, {"name": "detail", "scale": 0.5}]
    with pytest.raises(BadRequestError) as info:
        edit(shared_edit_server, mixed)
    assert info.value.body["param"] == "lora" and "cannot be paired" in info.value.body["message"]
    assert info.value.body["type"] == "invalid_request_error"
    c = OpenAI(
        base_url=f"{shared_wan_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT
    )
    with pytest.raises(BadRequestError) as info:
        c.videos.create(
            prompt="a cat",
            extra_body={"lora": [{"name": "motion"}, {"name": "motion", "scale": 2}]},
        )
    assert info.value.body["param"] == "lora"
