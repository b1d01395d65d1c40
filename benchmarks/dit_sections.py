"""The step sections of bench_dit_gpu.py and what they run on: random-weight FLUX and
GLM-Image transformers with one step's inputs (`tiny_flux_transformer`, `flux_inputs`,
`glm_transformer`, `glm_inputs`); section 1, the FLUX.1-dev-size step variants
(`flux_section`, which also hands back the informative extra variants to run last); section 2,
the GLM-Image CFG step (`glm_section`); section 3, the call sequence of the first served GLM-Image
requests under the old compile policy and ours (`served_sequence`).
"""

from __future__ import annotations

import json
import time

import torch
from diffusion_models import flux_pipe, rel_err
from dit_timing import (
    Call,
    compiled_opts,
    dit_flops,
    float32_reference,
    left_s,
    note,
    run_variants,
    timed_s,
)

from vllm_omni_plugin.diffusion.acceleration import (
    accelerate_transformer,
    reset_transformer,
)


# ---- models -------------------------------------------------------------------------------
def tiny_flux_transformer(device, dtype):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=64,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ).to(device, dtype)


def flux_inputs(tr, device, dtype, size: int, text_len: int) -> dict:
    """What diffusers' FLUX loop passes its transformer at one step (random values)."""
    from diffusers import FluxPipeline

    g = torch.Generator("cpu").manual_seed(0)
    h = size // 16
    cfg = tr.config

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    return dict(
        hidden_states=rnd(1, h * h, cfg.in_channels),
        timestep=torch.full([1], 0.7, device=device, dtype=dtype),
        guidance=torch.full([1], 3.5, device=device, dtype=torch.float32),
        pooled_projections=rnd(1, cfg.pooled_projection_dim),
        encoder_hidden_states=rnd(1, text_len, cfg.joint_attention_dim),
        txt_ids=torch.zeros(text_len, 3, device=device, dtype=dtype),
        img_ids=FluxPipeline._prepare_latent_image_ids(1, h, h, device, dtype),
        joint_attention_kwargs={},
        return_dict=False,
    )


def glm_transformer(device, dtype, tiny: bool):
    from diffusers import GlmImageTransformer2DModel

    from vllm_omni_plugin.testing.full_glm_image import DIT

    cfg = dict(DIT)
    if tiny:
        cfg.update(num_layers=2, attention_head_dim=16, num_attention_heads=2, text_embed_dim=32)
        cfg.update(prior_vq_quantizer_codebook_size=64)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype directly (no float32 copy)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            tr = GlmImageTransformer2DModel(**cfg)
    finally:
        torch.set_default_dtype(prev)
    return tr.eval()


def glm_inputs(tr, device, dtype, size: int, rows: list[tuple[int, bool]], seed: int = 0) -> dict:
    """One GLM forward over `rows` = [(glyph length, prior dropped?)], equal lengths."""
    g = torch.Generator("cpu").manual_seed(seed)
    cfg = tr.config
    b, lat = len(rows), size // 8
    tokens = (lat // cfg.patch_size) ** 2
    lens = {n for n, _ in rows}
    assert len(lens) == 1, "rows of one forward share a glyph length"
    n = lens.pop()
    return dict(
        hidden_states=torch.randn(b, cfg.in_channels, lat, lat, generator=g).to(device, dtype),
        encoder_hidden_states=torch.randn(b, n, cfg.text_embed_dim, generator=g).to(device, dtype),
        prior_token_id=torch.randint(
            0, cfg.prior_vq_quantizer_codebook_size, (b, tokens), generator=g
        ).to(device),
        prior_token_drop=torch.tensor([[d] * tokens for _, d in rows], device=device),
        timestep=torch.full([b], 700.0, device=device, dtype=dtype),
        target_size=torch.tensor([[size, size]] * b, device=device, dtype=dtype),
        crop_coords=torch.zeros(b, 2, device=device, dtype=dtype),
        attention_kwargs=None,
        return_dict=False,
    )


# ---- 1 + 2: step variants ------------------------------------------------------------------
def flux_section(args, device, dtype, budget) -> tuple[list, dict, object, dict]:
    tiny = args.tiny
    size, text_len = (64, 16) if tiny else (1024, 512)
    t = time.perf_counter()
    if tiny:
        pipe = None
        tr = tiny_flux_transformer(device, dtype)
    else:
        pipe = flux_pipe("full", device, dtype).to(device)
        tr = pipe.transformer
    tr.eval()
    kw = flux_inputs(tr, device, dtype, size, text_len)
    cfg = tr.config
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    flops = dit_flops(cfg.num_layers + cfg.num_single_layers, inner, (size // 16) ** 2 + text_len)
    call = Call(tr, [kw])
    with torch.inference_mode():
        ref = call()[0]
    ref32 = float32_reference(tr, [kw], dtype) if dtype != torch.float32 else ref
    base = rel_err(ref, ref32)
    info = dict(
        size=size,
        text_tokens=text_len,
        tflop_per_step=flops / 1e12,
        build_s=time.perf_counter() - t,
        bf16_eager_vs_fp32=base,
    )
    print(f"FLUX: {json.dumps(info)}", flush=True)
    cuda = device.type == "cuda"
    no_gpu = "skipped: CUDA only"
    fp8_why = None
    if cuda:
        from vllm_omni_plugin.diffusion.fp8 import fp8_supported

        fp8_why = fp8_supported(device)
    variants = [
        ("diffusers eager", "diffusers", 10, False),
        ("ours eager", {"cuda_graphs": False}, 10, False),
        (
            "ours eager + CUDA graphs",
            {"cuda_graphs": True} if cuda else None,
            15 if cuda else no_gpu,
            False,
        ),
        ("ours compiled", compiled_opts(cuda_graphs=False), 50, True),
        (
            "ours compiled + CUDA graphs (no fuse_gelu)",
            compiled_opts(cuda_graphs=True) if cuda else None,
            30 if cuda else no_gpu,
            True,
        ),
        (
            "ours compiled + CUDA graphs + fuse_gelu (the engine's default)",
            compiled_opts(cuda_graphs=True, fuse_gelu=True) if cuda else None,
            30 if cuda else no_gpu,
            True,
        ),
        (
            "ours fp8 (compiled + graphs)",
            compiled_opts(cuda_graphs=True, fp8=True) if cuda and fp8_why is None else None,
            60 if cuda and fp8_why is None else f"skipped: {fp8_why or 'CUDA only'}",
            False,
        ),
    ]
    # Run after every other section, if the budget still allows (informative, not acceptance).
    extras = [
        (
            "ours compiled dynamic=True + graphs",
            compiled_opts(cuda_graphs=cuda, dynamic=True),
            45,
            False,
        ),
        (
            "ours max-autotune (GEMM epilogue fusion) + graphs",
            compiled_opts(cuda_graphs=cuda, mode="max-autotune-no-cudagraphs"),
            240 if cuda else 120,
            True,
        ),
    ]
    if args.only_variants:
        keep = set(args.only_variants.split(","))
        variants = [v for v in variants + extras if v[0] in keep]
        extras = []
    warmup, iters = (1, 2) if tiny else (3, 10)
    rows = run_variants(
        "FLUX", tr, device, variants, call, flops, ref, ref32, budget, warmup, iters
    )

    def run_extras() -> list:
        return run_variants(
            "FLUX", tr, device, extras, call, flops, ref, ref32, budget, warmup, iters
        )

    return rows, info, pipe, run_extras


def glm_section(args, device, dtype, budget) -> tuple[list, dict, object]:
    tiny = args.tiny
    size = 64 if tiny else 1024
    t = time.perf_counter()
    tr = glm_transformer(device, dtype, tiny)
    cfg = tr.config
    # A prompt without quoted text: its glyph input and CFG's empty one are both 1 token, so
    # our adapter runs both rows in one forward (diffusers: two passes, as its pipeline does).
    glyph = 1
    cond = glm_inputs(tr, device, dtype, size, [(glyph, False)], seed=0)
    uncond = {
        **cond,
        "prior_token_drop": torch.ones_like(cond["prior_token_drop"]),
    }
    both = glm_inputs(tr, device, dtype, size, [(glyph, False), (glyph, True)], seed=0)
    both.update(  # the same rows as cond + uncond, so the outputs compare
        hidden_states=torch.cat([cond["hidden_states"]] * 2),
        encoder_hidden_states=torch.cat([cond["encoder_hidden_states"]] * 2),
        prior_token_id=torch.cat([cond["prior_token_id"]] * 2),
    )
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    tokens = (size // 8 // cfg.patch_size) ** 2 + glyph
    flops = dit_flops(cfg.num_layers, inner, tokens, batch=2)
    diffusers_call = Call(tr, [cond, uncond])
    ours_call = Call(tr, [both])
    with torch.inference_mode():
        ref = diffusers_call()[0]
    ref32 = float32_reference(tr, [cond, uncond], dtype) if dtype != torch.float32 else ref
    info = dict(
        size=size,
        layers=cfg.num_layers,
        inner=inner,
        tokens_per_row=tokens,
        tflop_per_cfg_step=flops / 1e12,
        build_s=time.perf_counter() - t,
        bf16_eager_vs_fp32=rel_err(ref, ref32),
    )
    print(f"GLM: {json.dumps(info)}", flush=True)
    cuda = device.type == "cuda"

    class Diffusers(Call):  # run_variants swaps the callee; diffusers' step stays two passes
        def with_fn(self, fn):
            return ours_call.with_fn(fn)

    variants = [
        ("diffusers eager (cond + uncond passes)", "diffusers", 10, False),
        ("ours eager (one forward, batch 2)", {"cuda_graphs": False}, 10, False),
        # (compiled without graphs: in the served sequence below; on CUDA the compile of GLM's
        # four shape classes happens in set-up)
        (
            "ours compiled + CUDA graphs (no fuse_gelu)",
            compiled_opts(cuda_graphs=cuda),
            75,
            False,
        ),
        (
            "ours compiled + CUDA graphs + fuse_gelu (the engine's default)",
            compiled_opts(cuda_graphs=cuda, fuse_gelu=True),
            75,
            True,
        ),
    ]
    warmup, iters = (1, 2) if tiny else (3, 10)
    rows = run_variants(
        "GLM",
        tr,
        device,
        variants,
        Diffusers(tr, [cond, uncond]),
        flops,
        ref,
        ref32,
        budget,
        warmup,
        iters,
    )
    return rows, info, tr


# ---- 3: the served-shape sequence --------------------------------------------------------------
def served_sequence(args, tr, device, dtype, budget) -> list:
    """The first served GLM-Image requests, call by call: warm-up (no quoted text: both CFG rows of glyph
    length 1 share one forward), then two prompts with quoted text (cond row longer: two
    forwards at batch 1 per step). Old policy vs ours, 2 steps per request."""
    size = 64 if args.tiny else 1024
    requests = [
        ("warm-up, no quoted text", 1),
        ('"OPEN" (5 glyph tokens)', 5),
        ("9 glyph tokens", 9),
    ]
    out = []
    for policy in ("old: torch automatic dynamic, host syncs", "ours"):
        cost = 30 if args.tiny else (90 if policy.startswith("old") else 60)
        if cost > left_s(budget):
            note(f"served sequence, {policy}: skipped, needs ~{cost}s, {left_s(budget):.0f}s left")
            continue
        reset_transformer(tr)
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        if policy.startswith("old"):
            for block in tr.transformer_blocks:
                block.compile()  # what the served stage did (compile_regional, no options)
            fn = tr
            setup_s = 0.0
        else:
            setup_s, fn = timed_s(
                lambda: accelerate_transformer(
                    tr, device, compile=True, regional=True, cuda_graphs=False
                ),
                device,
            )
        out.append(
            dict(
                policy=policy,
                request="start-up (ours: warm-up compiles)",
                step=0,
                batch=0,
                glyph_len=0,
                call_s=setup_s,
                graphs_compiled=int(counters["stats"]["unique_graphs"]),
            )
        )
        try:
            with torch.inference_mode():
                for label, glyph in requests:
                    if glyph == 1:
                        calls = [[(1, False), (1, True)]]
                    else:
                        calls = [[(glyph, False)], [(1, True)]]
                    kws = [glm_inputs(tr, device, dtype, size, rows) for rows in calls]
                    for step in range(2):
                        for kw in kws:
                            dt, _ = timed_s(lambda kw=kw, fn=fn: fn(**kw), device)
                            row = dict(
                                policy=policy,
                                request=label,
                                step=step,
                                batch=kw["hidden_states"].shape[0],
                                glyph_len=kw["encoder_hidden_states"].shape[1],
                                call_s=dt,
                                graphs_compiled=int(counters["stats"]["unique_graphs"]),
                            )
                            out.append(row)
                            print(json.dumps(row), flush=True)
        except Exception as exc:
            note(f"served sequence {policy} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            reset_transformer(tr)
            torch._dynamo.reset()
    return out
