"""One Qwen-Image denoising step at full size (60 blocks, 24 x 128 heads, 1024x1024: 4096 image
tokens) for 8 prompts of mixed text lengths: each alone (batch 1, one after the other) against
all 8 in one batch, the batch's attention masked over the padded text (diffusers) or per row
over each prompt's own tokens (diffusion/qwen_image_rows.py). Run by
`bench_dit_ab.py --qwen-rows`; it decides whether Qwen-Image's stage may batch (its
`max_batch_size`).

Every variant calls the same transformer the way the engine does (accelerate_transformer: the
sync-free call, regional compile, fuse_gelu and CUDA graphs on CUDA), with the inputs the adapter
builds: right-padded text embeddings with `encoder_hidden_states_mask`, and, for the per-row
variant, the rows' lengths in `attention_kwargs`. `--cfg` adds an unconditioned row per prompt
(negative prompts of other lengths), as true CFG does. Timed calls alternate between the
variants round by round (as the FLUX A/B), so a clock drop hits all of them alike.

The "floor" variant is the batch with every prompt at the longest length and no mask: no
padding, no mask, the fused kernel (not the same images; the speed a batch of equal prompts
would have). `per_image_ms` is a batch call's time over its 8 images (alone: the 8 calls' sum
over 8); `vs_alone` divides it by alone's. Accuracy: each batched variant's prediction against
the 8 alone predictions (relative error; bf16 on the GPU, so not zero).
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diffusion_models import call_times_ms, rel_err, sync  # noqa: E402

from vllm_omni_plugin.diffusion import qwen_image_rows  # noqa: E402
from vllm_omni_plugin.diffusion.acceleration import accelerate_transformer  # noqa: E402

# Templated prompts' text tokens after the template prefix: tens to a few hundred.
LENGTHS = (14, 23, 37, 52, 78, 110, 160, 230)
NEGATIVE_LENGTHS = (9, 9, 17, 9, 26, 9, 41, 12)  # `--cfg`: one unconditioned row per prompt
TINY_LENGTHS = (3, 5, 8, 4, 11, 6, 16, 7)
TINY_NEGATIVE_LENGTHS = (2, 2, 4, 2, 6, 2, 9, 3)


def transformer(device: torch.device, dtype: torch.dtype, tiny: bool) -> torch.nn.Module:
    """Random weights, seeded: the full-size DiT built on the device in `dtype` (no float32
    copy), or the tiny test DiT (2 blocks) for the CPU check."""
    if tiny:
        from vllm_omni_plugin.testing.tiny_qwen_image import build_transformer

        return build_transformer(0).to(device, dtype).eval()
    from diffusers import QwenImageTransformer2DModel

    from vllm_omni_plugin.testing.full_qwen_image import DIT

    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            tr = QwenImageTransformer2DModel(**DIT)
    finally:
        torch.set_default_dtype(prev)
    return tr.eval()


def rows_inputs(tr, lengths: list[int], size: int, device, dtype, seed: int = 0) -> list[dict]:
    """One row's (hidden, text, timestep) per entry of `lengths`: the same row wherever it runs."""
    cfg = tr.config
    tokens = (size // 16) ** 2
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for n in lengths:
        out.append(
            {
                "hidden": torch.randn(1, tokens, cfg.in_channels, generator=g).to(device, dtype),
                "text": torch.randn(1, n, cfg.joint_attention_dim, generator=g).to(device, dtype),
                "t": torch.rand(1, generator=g).to(device, dtype),
            }
        )
    return out


def call_kwargs(rows: list[dict], size: int, mode: str) -> dict:
    """The transformer's keyword arguments for `rows` as one batch. mode: "masked" (padded +
    mask), "per_row" (padded + mask + lengths; one length: its own text, no mask), "floor"
    (every text at the longest length, no mask)."""
    lengths = [r["text"].shape[1] for r in rows]
    longest = max(lengths)
    texts, masks = [], []
    for r, n in zip(rows, lengths, strict=True):
        t = r["text"]
        if mode == "floor":
            t = t.repeat(1, -(-longest // n), 1)[:, :longest]
        elif n < longest:
            t = torch.cat([t, t.new_zeros(1, longest - n, t.shape[2])], dim=1)
        texts.append(t)
        mask = torch.zeros(1, longest, dtype=torch.long, device=t.device)
        mask[:, :n] = 1
        masks.append(mask)
    padded = mode in ("masked", "per_row") and len(set(lengths)) > 1
    kwargs = {
        "hidden_states": torch.cat([r["hidden"] for r in rows]),
        "encoder_hidden_states": torch.cat(texts),
        "encoder_hidden_states_mask": torch.cat(masks) if padded else None,
        "timestep": torch.cat([r["t"] for r in rows]),
        "img_shapes": [[(1, size // 16, size // 16)]] * len(rows),
        "attention_kwargs": {},
        "return_dict": False,
    }
    if mode == "per_row" and padded:
        kwargs["attention_kwargs"] = {qwen_image_rows.TEXT_LENGTHS: tuple(lengths)}
    return kwargs


def qwen_rows(args, device: torch.device, dtype: torch.dtype, sampler, window_means) -> dict:
    """Build, warm (compile, capture) and time the variants; the result dict of the JSON."""
    cuda = device.type == "cuda"
    size = 64 if args.tiny else 1024
    lengths = list(TINY_LENGTHS if args.tiny else LENGTHS)
    negatives = list(TINY_NEGATIVE_LENGTHS if args.tiny else NEGATIVE_LENGTHS)
    rounds = args.rounds or (2 if args.tiny else 5)
    t0 = time.perf_counter()
    tr = transformer(device, dtype, args.tiny)
    built_s = time.perf_counter() - t0
    prompts = rows_inputs(tr, lengths, size, device, dtype)
    uncond = rows_inputs(tr, negatives, size, device, dtype, seed=1) if args.cfg else []
    per_prompt = [[p] for p in prompts]  # alone: a prompt's rows (and its uncond row)
    for rows, u in zip(per_prompt, uncond, strict=False):
        rows.append(u)
    batch = prompts + uncond  # the adapter's order: cond rows, then uncond rows
    fn = accelerate_transformer(
        tr,
        device,
        compile=not args.tiny,
        regional=True,
        cuda_graphs=cuda,
        max_graphs=16,  # 8 alone shapes + the batch variants, none evicted
        fuse_gelu=cuda,
    )
    # Alone is the engine's batch-1 call: with CFG, the prompt's two rows (their lengths differ)
    # in one forward, per row; without, one row and its own text.
    alone_kwargs = [call_kwargs(rows, size, "per_row") for rows in per_prompt]
    calls: dict[str, Callable[[], object]] = {
        "alone (batch 1, each prompt in turn)": lambda: [fn(**kw) for kw in alone_kwargs],
    }
    batch_kwargs = {}
    for mode, name in (
        ("masked", "batch 8, masked attention (diffusers)"),
        ("per_row", "batch 8, per-row attention"),
        ("floor", "floor: batch 8, all at the longest text, no mask"),
    ):
        batch_kwargs[name] = call_kwargs(batch, size, mode)
        calls[name] = lambda kw=batch_kwargs[name]: fn(**kw)
    setup: dict[str, dict] = {}
    with torch.inference_mode():
        alone_out = None
        for name, call in calls.items():
            t = time.perf_counter()
            before = qwen_image_rows.counts(tr)
            out = call()
            call()  # captured here where graphed
            sync(device)
            after = qwen_image_rows.counts(tr)
            setup[name] = {
                "first_two_calls_s": time.perf_counter() - t,
                "attention_calls": {k: after[k] - before[k] for k in after},
            }
            if name.startswith("alone"):
                # each prompt's conditioned row, in batch order (then the unconditioned ones)
                preds = [o[0] for o in out]
                alone_out = torch.cat([p[:1] for p in preds] + [p[1:] for p in preds])
            elif not name.startswith("floor"):
                setup[name]["rel_err_vs_alone"] = rel_err(out[0], alone_out)
            print(f"{name}: {setup[name]}", flush=True)

    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    round_medians: dict[str, list[float]] = {n: [] for n in names}
    windows: dict[str, list] = {n: [] for n in names}
    with torch.inference_mode():
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                calls[name]()
                sync(device)
                start = dt.datetime.now()
                got = call_times_ms(calls[name], device, args.calls)
                windows[name].append((start, dt.datetime.now()))
                times[name] += got
                round_medians[name].append(statistics.median(got))
            print(f"round {r}: " + ", ".join(f"{n} {round_medians[n][-1]:.1f}" for n in names))
    samples = sampler.stop()

    images = len(prompts)
    alone_name = names[0]
    alone_per_image = statistics.median(times[alone_name]) / images
    rows = []
    for name in names:
        med = statistics.median(times[name])
        per_image = med / images
        # a batch call and alone's 8 calls both make the 8 images
        wins = sum(
            a < b for a, b in zip(round_medians[name], round_medians[alone_name], strict=True)
        )
        rows.append(
            {
                "variant": name,
                "median_ms": med,
                "min_ms": min(times[name]),
                "per_image_ms": per_image,
                "vs_alone": per_image / alone_per_image,
                "round_medians_ms": round_medians[name],
                "rounds_faster_than_alone": None if name == alone_name else wins,
                "clock": window_means(samples, windows[name]),
                **setup[name],
            }
        )
    return {
        "size": size,
        "text_lengths": lengths,
        "negative_lengths": negatives if args.cfg else None,
        "rows_per_batch": len(batch),
        "cfg": bool(args.cfg),
        "build_s": built_s,
        "rounds": rounds,
        "calls_per_round": args.calls,
        "rows": rows,
    }


def markdown(result: dict) -> str:
    lines = [
        f"{result['machine']}, {result['software']}; Qwen-Image step at {result['size']}x"
        f"{result['size']}, 8 prompts of text lengths {result['text_lengths']}"
        + (f", true CFG (negatives {result['negative_lengths']})" if result["cfg"] else "")
        + f"; {result['rounds']} interleaved rounds x {result['calls_per_round']} calls",
        "",
        "| variant | median ms / call | ms per image | vs alone | rounds faster than alone "
        "| SM MHz | rel. err vs alone | per-row / masked attention calls |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        clock = r["clock"] or {}
        err = r.get("rel_err_vs_alone")
        calls = r["attention_calls"]
        lines.append(
            f"| {r['variant']} | {r['median_ms']:.1f} | {r['per_image_ms']:.1f} | "
            f"{r['vs_alone']:.3f} | "
            f"{'-' if r['rounds_faster_than_alone'] is None else r['rounds_faster_than_alone']}"
            f" | {clock.get('sm_clock_mhz', float('nan')):.0f} | "
            f"{'-' if err is None else f'{err:.1e}'} | {calls['per_row']} / {calls['masked']} |"
        )
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- qwen-rows:begin -->", "<!-- qwen-rows:end -->"


def report(paths: list[Path]) -> str:
    """The tables of the given results files (bench_dit_ab.py --qwen-rows JSON), newest last."""
    return "\n".join(
        f"From `{p.name}`:\n\n{markdown(json.loads(p.read_text()))}" for p in sorted(paths)
    )


if __name__ == "__main__":
    import argparse

    from fair_report import write_into

    parser = argparse.ArgumentParser(description="BENCHMARKS.md's per-row batching tables")
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--write", type=Path, default=None, help="markdown file with the markers")
    args = parser.parse_args()
    text = report(args.results)
    if args.write:
        write_into(args.write, text, BEGIN, END)
    else:
        print(text)
