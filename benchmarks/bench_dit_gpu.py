"""DiT speed on one GPU: step variants, GLM-Image CFG step, the served-shape finding,
end-to-end images. One script, one time budget; prints a markdown table and a JSON line.

    python benchmarks/bench_dit_gpu.py --out DIR            # H200: full sizes, ~8 minutes
    python benchmarks/bench_dit_gpu.py --tiny               # CPU: tiny sizes, checks the code

All weights are random and built in-process on the device (no downloads); needs torch,
diffusers, transformers and this package (no vLLM).

Sections, in order (each variant has a cost estimate and is skipped, with a note, when the
budget left is smaller):
  1. FLUX.1-dev-size transformer, one forward at 1024x1024 (4096 image + 512 text tokens),
     batch 1: diffusers eager, ours eager, ours eager + CUDA graphs, ours regional compile,
     ours compile + CUDA graphs, ours fp8 (compile + graphs); median/min (CUDA events), TFLOP/s,
     first-call and capture time, relative error vs the bf16 eager output and vs a float32
     forward of the same weights and inputs; the compiled step's top kernels (fusion check).
  2. GLM-Image DiT at its real size (testing/full_glm_image.py: 30 layers, 32 x 128) with CFG
     at 1024x1024: diffusers (two passes, as its pipeline) vs ours (both rows in one forward)
     eager, compiled, compiled + graphs.
  3. The served-shape sequence (why the first served requests were slow): their transformer calls as
     the GLM adapter makes them (CFG rows of equal glyph length share a forward; a quoted text
     makes the cond row longer, so cond and uncond run apart at batch 1), under the old policy
     (regional compile, torch's automatic dynamic shapes, diffusers' forward with its host
     syncs) and ours; per call: time (compiles included), graphs compiled so far.
  4. End to end, FLUX.1-dev-size pipeline (small random text encoders, FLUX-size VAE) at
     1024x1024, 28 and 50 steps: diffusers eager, diffusers + regional compile, our engine
     (regional compile + CUDA graphs), text encoding + denoising + VAE decode; and how often a
     warm engine step makes the host wait for the GPU (torch's sync debug mode; goal 0).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diffusion_models import flux_pipe  # noqa: E402
from dit_end_to_end import end_to_end  # noqa: E402
from dit_report import markdown  # noqa: E402
from dit_sections import flux_section, glm_section, glm_transformer, served_sequence  # noqa: E402
from dit_timing import NOTES, T0, left_s  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU (code check)")
    ap.add_argument("--budget-s", type=float, default=460.0, help="total seconds (default 460)")
    ap.add_argument("--sections", default="flux,glm,served,e2e")
    ap.add_argument("--only-variants", default=None, help="FLUX variant names, comma-separated")
    ap.add_argument("--out", default=None, help="folder for dit_gpu.json and dit_gpu.md")
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    sections = set(args.sections.split(","))
    budget = args.budget_s
    machine = torch.cuda.get_device_name() if device.type == "cuda" else platform.machine()
    import diffusers

    software = f"torch {torch.__version__}, diffusers {diffusers.__version__}"
    if device.type == "cuda":
        software += f", CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
    result: dict = {"machine": machine, "software": software, "command": " ".join(sys.argv)}
    pipe = None
    run_extras = None
    if "flux" in sections:
        rows, info, pipe, run_extras = flux_section(args, device, dtype, budget)
        result["flux"] = {"info": info, "rows": rows}
        save(result, args.out)
    glm_tr = None
    if "glm" in sections and left_s(budget) > 30:
        rows, info, glm_tr = glm_section(args, device, dtype, budget)
        result["glm"] = {"info": info, "rows": rows}
        save(result, args.out)
    if "served" in sections:
        if glm_tr is None:
            glm_tr = glm_transformer(device, dtype, args.tiny)
        result["served_sequence"] = served_sequence(args, glm_tr, device, dtype, budget)
        save(result, args.out)
    del glm_tr
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if "e2e" in sections:
        if pipe is None and not args.tiny:
            pipe = flux_pipe("full", device, dtype).to(device)
        result["end_to_end"] = end_to_end(args, pipe, device, dtype, budget)
        save(result, args.out)
    if run_extras is not None:
        result["flux"]["rows"] += run_extras()
    result["notes"] = NOTES
    result["total_s"] = time.perf_counter() - T0
    md = markdown(result)
    print("\n" + md, flush=True)
    print(json.dumps(result, default=str), flush=True)
    save(result, args.out, md)


def save(result: dict, out: str | None, md: str | None = None) -> None:
    """Write what is measured so far (after every section: a run cut short by its time limit
    still leaves its finished sections), and the markdown table at the end."""
    if not out:
        return
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dit_gpu.json").write_text(json.dumps(result, indent=1, default=str))
    if md is not None:
        (folder / "dit_gpu.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
