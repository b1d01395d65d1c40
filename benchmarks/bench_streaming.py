"""What a streaming preview costs, next to a denoising step, on the tiny CPU models.

    python benchmarks/bench_streaming.py                  # qwen-image, glm-image (DiT), flux
    python benchmarks/bench_streaming.py --size 128 --steps 12 --repeats 5

A preview (`partial_images` of a streaming request) is the request's x0 prediction decoded with
the family's own VAE decode, in the step that reached a preview step; the requests batched with
it wait for that decode. Measured per family, at --size, with 8 requests batched step by step:

  * step_ms: one denoising step of the batch of 8 (the median over steps);
  * preview_ms: one preview decode of one request's image (1 image), and its ratio to step_ms;
  * bound_ms: what a streaming request may add to the others in its batch: partial_images (3)
    previews, each one decode of its n images: 3 x preview_ms for n = 1;
  * others_ms / others_stream_ms: the latency of the 7 other requests with no streaming request
    in the batch vs with one streaming request asking for 3 previews (the minimum over
    --repeats: the machine is shared), and `added_ms`, their difference, checked against
    bound_ms (within 25 % + 5 ms of noise);
  * the 7 others' images are compared: with and without the streaming neighbour they must be
    bit-identical (a preview never touches the latents).

Needs only torch + diffusers + this package. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.testing.tiny_models import build_tiny_model

BATCH = 8


def requests(engine, family: str, size: int, steps: int, stream_first: bool, tag: str):
    out = []
    for i in range(BATCH):
        prior = None
        if family == "glm-image":
            adapter = engine.adapter
            grid = adapter.vae_scale_factor * adapter.patch
            vocab = int(adapter.pipe.transformer.config.prior_vq_quantizer_codebook_size)
            gen = torch.Generator().manual_seed(i)
            prior = torch.randint(0, vocab, (1, (size // grid) ** 2), generator=gen)
        out.append(
            GenerationRequest(
                f"{tag}-{i}",
                f"prompt number {i}",
                height=size,
                width=size,
                num_inference_steps=steps,
                seed=100 + i,
                prior_token_ids=prior,
                partial_images=3 if (stream_first and i == 0) else 0,
            )
        )
    return out


def run_batch(engine, reqs):
    """All requests join at once; (latency per id, images per id, step times, preview count)."""
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    done, images, step_ms, previews = {}, {}, [], 0
    while engine.has_unfinished():
        s0 = time.perf_counter()
        outs = engine.step()
        took = (time.perf_counter() - s0) * 1e3
        got = engine.take_previews()
        previews += len(got)
        if not outs and not got:
            step_ms.append(took)  # a plain denoising step (no decode of any kind in it)
        for o in outs:
            done[o.request_id] = time.perf_counter() - t0
            images[o.request_id] = np.asarray(o.images[0])
    return done, images, step_ms, previews


def preview_cost(engine, family: str, size: int, repeats: int) -> float:
    """One preview decode of one 1-image request, ms (median of `repeats`)."""
    (r,) = requests(engine, family, size, 4, True, "probe")[:1]
    engine.add_request(r)
    engine.step()  # prepare + step 0
    state = engine.scheduler.find(r.request_id)
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            state.x0 = state.latents.clone()
            t0 = time.perf_counter()
            engine.adapter.preview([state])
            times.append((time.perf_counter() - t0) * 1e3)
    engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def bench(family: str, root: Path, size: int, steps: int, repeats: int) -> dict:
    model = build_tiny_model(family, root / family, seed=0)
    engine = DiffusionEngine(DiffusionEngineConfig(model=str(model), max_batch_size=BATCH))
    run_batch(engine, requests(engine, family, size, 2, False, "warm"))  # first-call costs
    preview_ms = preview_cost(engine, family, size, repeats)
    plain_ms, stream_ms, steps_ms = [], [], []
    same = True
    for k in range(repeats):
        done, img_a, st, _ = run_batch(
            engine, requests(engine, family, size, steps, False, f"a{k}")
        )
        others = [done[f"a{k}-{i}"] for i in range(1, BATCH)]
        plain_ms.append(statistics.mean(others) * 1e3)
        steps_ms.extend(st)
        done, img_b, _, previews = run_batch(
            engine, requests(engine, family, size, steps, True, f"b{k}")
        )
        assert previews == 3, previews
        stream_ms.append(statistics.mean(done[f"b{k}-{i}"] for i in range(1, BATCH)) * 1e3)
        same &= all((img_a[f"a{k}-{i}"] == img_b[f"b{k}-{i}"]).all() for i in range(1, BATCH))
    step_ms = statistics.median(steps_ms)
    added = min(stream_ms) - min(plain_ms)
    bound = 3 * preview_ms
    return {
        "family": family,
        "size": size,
        "steps": steps,
        "step_ms": round(step_ms, 2),
        "preview_ms": round(preview_ms, 2),
        "preview_per_step": round(preview_ms / step_ms, 2),
        "bound_ms": round(bound, 2),
        "others_ms": round(min(plain_ms), 2),
        "others_stream_ms": round(min(stream_ms), 2),
        "added_ms": round(added, 2),
        "within_bound": added <= 1.25 * bound + 5.0,
        "others_identical": bool(same),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="qwen-image,glm-image,flux")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            rows.append(bench(family, Path(tmp), args.size, args.steps, args.repeats))
    cols = list(rows[0])
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(str(row[c]) for c in cols))
    print(json.dumps({"torch_threads": torch.get_num_threads(), "results": rows}))
    return 0 if all(r["within_bound"] and r["others_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
