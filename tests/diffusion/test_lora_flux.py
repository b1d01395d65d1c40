"""LoRA adapters per request on tiny FLUX, against diffusers' `load_lora_weights` +
`set_adapters(names, weights)` on the same checkpoint, adapters and seed.

Tolerance: every pixel within 2 of diffusers' on the 0-255 scale and a mean difference <= 0.05
(float32 on CPU; the grouped per-row matmuls sum in another order than PEFT's layer), alone and
in a mixed batch (plain rows, one adapter, two adapters with their own scales, a negative scale,
n = 2) that shares each forward. An adapter changes the image by far more than that (checked),
so the comparison cannot pass by ignoring it. Bad adapters are refused naming `lora`, with
nothing loaded.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.errors import DiffusionEngineError, RequestValidationError
from vllm_omni_plugin.diffusion.lora.tiny import build_tiny_lora

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: per-op overhead

SIZE = 64
STEPS = 2


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("flux")


@pytest.fixture(scope="module")
def lora_dir(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    build_tiny_lora(model_dir, root / "style", rank=4, seed=1)
    build_tiny_lora(model_dir, root / "detail", rank=8, seed=2)
    build_tiny_lora(model_dir, root / "third", rank=2, seed=3)
    build_tiny_lora(model_dir, root / "big", rank=16, seed=4)  # above max_rank below
    (root / "broken").mkdir()
    (root / "broken" / "pytorch_lora_weights.safetensors").write_bytes(b"\x10\x00\x00\x00{not json")
    return root


@pytest.fixture(scope="module")
def engine(model_dir, lora_dir):
    lora = {"dir": str(lora_dir), "max_loaded": 2, "max_rank": 8}
    return DiffusionEngine(DiffusionEngineConfig(model=str(model_dir), max_batch_size=8, lora=lora))


@pytest.fixture(scope="module")
def pipe(model_dir, lora_dir):
    from diffusers import FluxPipeline

    p = FluxPipeline.from_pretrained(str(model_dir))
    p.set_progress_bar_config(disable=True)
    for name in ("style", "detail"):
        p.load_lora_weights(str(lora_dir / name), adapter_name=name)
    return p


def req(rid, seed, lora=None, n=1, steps=STEPS):
    return GenerationRequest(
        rid,
        "a photo of a cat",
        n=n,
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
        guidance_scale=3.5,
        seed=seed,
        lora=lora,
    )


def px(images) -> np.ndarray:
    return np.stack([np.asarray(i, dtype=np.float64) for i in images])


def reference(pipe, r: GenerationRequest) -> np.ndarray:
    if r.lora:
        pipe.enable_lora()
        pipe.set_adapters([x["name"] for x in r.lora], [x.get("scale", 1.0) for x in r.lora])
    else:
        pipe.disable_lora()
    images = pipe(
        r.prompt,
        guidance_scale=r.guidance_scale,
        height=SIZE,
        width=SIZE,
        num_inference_steps=r.num_inference_steps,
        num_images_per_prompt=r.n,
        generator=torch.Generator("cpu").manual_seed(r.seed),
    ).images
    return px(images)


def assert_close(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    diff = np.abs(got - ref)
    assert diff.max() <= 2 and diff.mean() <= 0.05, (what, diff.max(), diff.mean())


def test_alone_equals_diffusers_and_the_adapter_matters(engine, pipe):
    (plain,) = engine.generate([req("plain", 7)])
    (styled,) = engine.generate([req("styled", 7, [{"name": "style", "scale": 0.8}])])
    ref = reference(pipe, req("r", 7, [{"name": "style", "scale": 0.8}]))
    assert_close(px(styled.images), ref, "style alone")
    assert np.abs(px(styled.images) - px(plain.images)).mean() > 5  # far above the tolerance


def test_mixed_batch_shares_forwards_and_equals_diffusers(engine, pipe):
    base = engine.adapter.pipe.transformer.transformer_blocks[0].attn.to_q.weight.clone()
    reqs = [
        req("m0", 1),
        req("m1", 2, [{"name": "style", "scale": 1.0}]),
        req("m2", 3, [{"name": "style", "scale": 0.5}, {"name": "detail", "scale": 1.2}]),
        req("m3", 4, [{"name": "detail", "scale": -0.7}], n=2),
    ]
    outs = engine.generate(reqs)
    assert min(o.metrics["max_batch"] for o in outs) == 5  # every row in one forward
    for r, o in zip(reqs, outs, strict=True):
        assert o.error is None
        assert_close(px(o.images), reference(pipe, r), r.request_id)
    # Base weights untouched (nothing fused), adapters resident within max_loaded.
    assert torch.equal(engine.adapter.pipe.transformer.transformer_blocks[0].attn.to_q.weight, base)
    assert sorted(engine.lora.resident()) == ["detail", "style"]


def test_lru_keeps_max_loaded_and_evicts_the_least_recent(engine):
    engine.generate([req("s", 1, [{"name": "style"}], steps=1)])
    engine.generate([req("d", 1, [{"name": "detail"}], steps=1)])
    loads = engine.lora.loads
    engine.generate([req("t", 1, [{"name": "third"}], steps=1)])  # evicts "style" (oldest use)
    assert engine.lora.resident() == ["detail", "third"]
    assert engine.lora.loads == loads + 1
    engine.generate([req("d2", 1, [{"name": "detail"}], steps=1)])  # resident: no load
    assert engine.lora.loads == loads + 1


def test_a_request_waits_while_every_slot_is_pinned(engine):
    # max_loaded = 2: both slots pinned by the first request; the second (a third adapter)
    # starts only once the first has finished, and then runs.
    engine.add_request(req("p1", 1, [{"name": "style"}, {"name": "detail"}]))
    done = {o.request_id: o for o in engine.step()}  # p1 admitted and pinned
    engine.add_request(req("p2", 2, [{"name": "third"}]))
    done.update({o.request_id: o for o in engine.step()})
    assert engine.scheduler.find("p2") in engine.scheduler.waiting
    while engine.has_unfinished():
        for o in engine.step():
            done[o.request_id] = o
    assert done["p1"].error is None and done["p2"].error is None
    assert done["p2"].metrics["max_batch"] == 1  # never shared a forward with p1


def _other_family_adapter(tiny_models, root):
    build_tiny_lora(tiny_models("qwen-image"), root / "qwen-style", rank=4, seed=5)


@pytest.mark.parametrize(
    "lora, message",
    [
        ([{"name": "missing"}], "no adapter folder 'missing'"),
        ([{"name": "big"}], "rank 16 at"),
        ([{"name": "broken"}], "not a readable safetensors file"),
        ([{"name": "qwen-style"}], "does not fit FLUX"),
        ([{"name": "style", "path": "../outside"}], "outside the adapter directory"),
        ([{"name": "linked"}], "outside the adapter directory"),
        ([{"name": "style"}, {"name": "detail"}, {"name": "third"}], "exceed lora.max_loaded=2"),
        ([{"name": "style", "scale": "high"}], "must be a number"),
        ([{"name": "../style"}], "adapter name"),
        ([{"name": "style", "weight": 1}], "unknown key"),
    ],
)
def test_bad_adapters_are_refused_and_nothing_loads(
    engine, lora_dir, tiny_models, tmp_path_factory, lora, message
):
    if not (lora_dir / "qwen-style").exists():
        _other_family_adapter(tiny_models, lora_dir)
        outside = tmp_path_factory.mktemp("outside")
        build_tiny_lora(engine.config.model, outside / "adapter", rank=2, seed=9)
        os.symlink(outside / "adapter", lora_dir / "linked")
    resident, loads = engine.lora.resident(), engine.lora.loads
    with pytest.raises(RequestValidationError) as info:
        engine.add_request(req("bad", 1, lora))
    assert info.value.field.startswith("lora")
    assert message in info.value.message
    assert engine.lora.resident() == resident and engine.lora.loads == loads
    assert engine.scheduler.find("bad") is None


def test_no_lora_section_refuses_adapters(model_dir):
    plain = DiffusionEngine(DiffusionEngineConfig(model=str(model_dir)))
    with pytest.raises(RequestValidationError, match="serves no LoRA adapters"):
        plain.validate(req("x", 1, [{"name": "style"}]))


def test_lora_refuses_what_it_cannot_run_under(model_dir, lora_dir):
    for extra in ({"fuse_gelu": True}, {"step_cache": {"policies": ["first_block"]}}):
        cfg = DiffusionEngineConfig(model=str(model_dir), lora={"dir": str(lora_dir)}, **extra)
        with pytest.raises(DiffusionEngineError, match="lora cannot be combined"):
            DiffusionEngine(cfg)


def test_make_tiny_lora_writes_diffusers_format(lora_dir):
    from safetensors import safe_open

    with safe_open(str(lora_dir / "style" / "pytorch_lora_weights.safetensors"), "pt") as f:
        keys = list(f.keys())
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
    assert "transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in keys
    assert all(k.startswith("transformer.") for k in keys)
    assert meta["transformer.r"] == 4 and meta["transformer.lora_alpha"] == 8
