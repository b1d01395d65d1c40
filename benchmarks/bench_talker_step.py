"""Qwen3-Omni's talker at full size on one GPU, without the server: the talker as vLLM's model,
stepped by vLLM's engine (talker_step_vllm.py), its decode step time at batch 1, 8 and 32,
greedy and with the checkpoint's sampling, beside the step's memory-bandwidth floor (the bytes
of weights it reads over the device's memory bandwidth) and their ratio.

    python3 benchmarks/bench_talker_step.py --work /dev/shm/talker-full --out OUT [--eager]
    python3 benchmarks/bench_talker_step.py report OUT/talker_step.json [MORE.json] \
        --write BENCHMARKS.md  # the tables between <!-- talker-step:begin/end -->
    python3 benchmarks/bench_talker_step.py --device cpu --tiny --work DIR --out OUT
        # the tiny checkpoint, small batches: a CPU dry run (< 1 min)

The checkpoint: the full-size talker, Code2Wav and the thinker's token embedding only (what the
speech stages load, ~8 GB), random bf16 weights (testing/full_qwen3_omni.py's config), and the
prefill embeddings of 8 chat prompts conditioned as the talker stage does
(models/qwen3_omni/prompt.py). Every request runs `--frames` frames: the talker's end code is
ignored (random weights would end answers at random). One frame is 80 ms of audio, so a step
time under 80 ms is faster than real time for every request of the batch.

`report` also prints the tables of older result files, which timed a torch talker engine and
Code2Wav (their `talker` and `code2wav` rows).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from talker_step_vllm import hbm_bytes_per_s  # noqa: E402

BEGIN, END = "<!-- talker-step:begin -->", "<!-- talker-step:end -->"
DEVICE = "cuda"


BUILT = ".built"  # written last: the folder holds a whole checkpoint in the hub's layout


def hub_experts(state: dict) -> dict:
    """transformers' 3-D expert tensors (`...mlp.experts.gate_up_proj` `[E, 2I, H]`,
    `down_proj` `[E, H, I]`) -> the hub's per-expert `...experts.N.{gate,up,down}_proj.weight`,
    the names vLLM's loader reads."""
    out = {}
    for key, value in state.items():
        prefix, _, name = key.rpartition(".")
        if not prefix.endswith(".mlp.experts") or name not in ("gate_up_proj", "down_proj"):
            out[key] = value
            continue
        for e in range(value.shape[0]):
            if name == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = value[e]
            else:
                gate, up = value[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
    return out


def build(work: Path) -> Path:
    """Talker + Code2Wav + thinker embedding at full size, random, in `work` (kept if there),
    and the prompts' prefill embeddings (talker_step_vllm.write_prompts)."""
    if (work / BUILT).exists():
        return work
    from safetensors.torch import save_file
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

    from vllm_omni_plugin.testing import full_qwen3_omni as full
    from vllm_omni_plugin.testing.tiny_qwen3_omni import (
        build_tokenizer,
        init_talker_experts,
        make_audible,
        token_ids,
        write_processor_files,
    )

    work.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(
        full.SPECIALS, role_ids=full.ROLE_IDS, vocab_size=full.TEXT_VOCAB_SIZE
    )
    config = full.build_config(token_ids(tokenizer, full.SPECIALS))
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE), torch.no_grad():
            talker = hf.Qwen3OmniMoeTalkerForConditionalGeneration._from_config(
                config.talker_config
            )
            init_talker_experts(SimpleNamespace(config=config, talker=talker))
            code2wav = hf.Qwen3OmniMoeCode2Wav._from_config(config.code2wav_config)
            make_audible(code2wav, 1)
            text = config.thinker_config.text_config
            embed = torch.randn(text.vocab_size, text.hidden_size) * text.initializer_range
    finally:
        torch.set_default_dtype(previous)
    state = {f"talker.{k}": v for k, v in hub_experts(talker.state_dict()).items()}
    embedding = torch.nn.Embedding.from_pretrained(embed)
    state.update({f"code2wav.{k}": v for k, v in code2wav.state_dict().items()})
    state["thinker.model.embed_tokens.weight"] = embed
    save_file({k: v.contiguous() for k, v in state.items()}, str(work / "model.safetensors"))
    config.save_pretrained(work)
    write_processor_files(work, tokenizer)
    from talker_step_vllm import write_prompts

    from vllm_omni_plugin.models.qwen3_omni.prompt import TalkerConditioner

    write_prompts(work, TalkerConditioner(config, embedding, talker))
    (work / BUILT).touch()
    return work


def build_tiny(work: Path) -> Path:
    """The tiny checkpoint (testing/tiny_qwen3_omni.py, float32) and its prompts, in `work`."""
    if (work / BUILT).exists():
        return work
    from talker_step_vllm import load_prompts

    from vllm_omni_plugin.testing.tiny_qwen3_omni import build as build_tiny_checkpoint

    build_tiny_checkpoint(work, seed=0)
    load_prompts(work)
    (work / BUILT).touch()
    return work


def vllm_table(runs: list[tuple[Path, dict]]) -> str:
    """The vLLM talker's rows (sampling, batch) beside their bandwidth floors."""
    lines = [
        "| talker on vLLM's engine, sampling | batch | frames each | step ms (median) | p90 "
        "| floor ms (weights read / HBM bandwidth) | step / floor | weights read MB "
        "| of which routed experts MB | floor ms with KV reads | audio s per wall s "
        "| result file |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path, run in runs:
        # Floors from the bytes the file counted, at its device's bandwidth (files before the
        # bandwidth was looked up by device recorded every floor at the H200's).
        bytes_per_s = hbm_bytes_per_s(run.get("device", ""))
        for r in run.get("talker_vllm", ()):
            mb = r["weight_bytes"]
            floor = mb["total"] / bytes_per_s * 1e3
            floor_kv = (mb["total"] + r["kv_bytes"]) / bytes_per_s * 1e3
            lines.append(
                f"| {r['sampling']} | {r['batch']} | {r['frames']} | {r['step_ms']} "
                f"| {r['step_ms_p90']} | {floor:.4g} | {r['step_ms'] / floor:.3g} "
                f"| {mb['total'] / 1e6:.1f} | {mb['routed_experts'] / 1e6:.1f} "
                f"| {floor_kv:.4g} | {r['audio_s_per_wall_s']} | {path.name} |"
            )
    profiled = [(path, run) for path, run in runs if run.get("profile")]
    if profiled:
        lines += [
            "",
            "| profiled (torch profiler, decode steps) | batch | code predictor's layers compiled "
            "| step ms under the profiler | GPU-busy ms per step | kernels per step |",
            "|---|---|---|---|---|---|",
        ]
        for path, run in profiled:
            p = run["profile"]
            lines.append(
                f"| {path.name} | {p['batch']} | {run.get('predictor_compiled', False)} "
                f"| {p['step_wall_ms']} | {p['gpu_busy_ms_per_step']} | {p['kernels_per_step']:.0f} |"
            )
    lines.append("")
    for path, run in runs:
        if "talker_vllm" in run:
            lines.append(
                f"- {path.name}: {run['device']}, torch {run['torch']}, vLLM {run['vllm']}, "
                f"{run['dtype']}, CUDA graphs: {run['cuda_graphs']}, code predictor's layers "
                f"compiled: {run.get('predictor_compiled', False)}; engine load (s): "
                f"{run['load_s']}; checkpoint build (s): {run['build_s']}"
            )
    return "\n".join(lines) + "\n"


def report_table(paths: list[Path]) -> str:
    """Markdown from result files: the vLLM engine's table, then older files' torch engine's."""
    runs = [(p, json.loads(p.read_text())) for p in paths]
    parts = []
    if any("talker_vllm" in r for _, r in runs):
        parts.append(vllm_table(runs))
    if any("talker" in r for _, r in runs):
        parts.append(torch_table(runs))
    return "\n".join(parts)


def torch_table(runs: list[tuple[Path, dict]]) -> str:
    """Older result files' rows: a torch talker engine's (variant, batch), then Code2Wav's."""
    runs = [(p, r) for p, r in runs if "talker" in r]
    lines = [
        "| talker engine | batch | frames each | step ms (median) | p90 | real-time factor "
        "| audio s per wall s | result file |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = {
        "baseline": "before (per-request attention loop)",
        "eager": "slot cache, eager",
        "graphs": "slot cache + CUDA graphs",
    }
    for path, run in runs:
        labels = {**names, **run.get("labels", {})}
        for r in run["talker"]:
            lines.append(
                f"| {labels.get(r['variant'], r['variant'])} | {r['batch']} | {r['frames']} | {r['step_ms']} "
                f"| {r['step_ms_p90']} | {r['rtf']} | {r['audio_s_per_wall_s']} | {path.name} |"
            )
    lines += ["", "| Code2Wav, fed a frame per request per step | batch | audio s per wall s |"]
    lines.append("|---|---|---|")
    for path, run in runs:
        for r in run["code2wav"]:
            lines.append(f"| {path.name} | {r['batch']} | {r['audio_s_per_wall_s']} |")
    lines.append("")
    for path, run in runs:
        equal = run.get("graphs_vs_eager_equal_frames")
        before = run.get("graphs_vs_baseline_equal_frames")
        lines.append(
            f"- {path.name}: {run['device']}, torch {run['torch']}; engine load with graph "
            f"capture (s): {run.get('load_s')}"
            + (f"; graphed frames equal to eager (bf16): {equal}" if equal else "")
            + (f"; graphed frames equal to the baseline's (bf16): {before}" if before else "")
            + (
                f"; vLLM's GPU-only kernels used: {run['gpu_kernels']}"
                if run.get("gpu_kernels")
                else ""
            )
            + (
                "; one prefill's last hidden vs transformers' talker forward, max |diff| / "
                f"max |ref|: {run['fused_vs_modules']}"
                if run.get("fused_vs_modules")
                else ""
            )
            + (f"; errors: {run['errors']}" if run.get("errors") else "")
        )
    return "\n".join(lines) + "\n"


def report_cmd(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="bench_talker_step.py report")
    ap.add_argument("results", type=Path, nargs="+")
    ap.add_argument("--write", type=Path)
    args = ap.parse_args(argv)
    text = report_table(args.results)
    if args.write:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from fair_report import write_into

        write_into(args.write, text, BEGIN, END)
    else:
        print(text)


def main() -> None:
    if sys.argv[1:2] == ["report"]:
        return report_cmd(sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/dev/shm/talker-full")
    ap.add_argument("--out", required=True)
    ap.add_argument("--frames", type=int)
    ap.add_argument("--batches")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny checkpoint (a CPU dry run)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--samplings", default="greedy,checkpoint", help="greedy, checkpoint")
    ap.add_argument(
        "--profile",
        type=int,
        metavar="BATCH",
        help="then profile 20 decode steps at this batch (the engine runs in this process)",
    )
    args = ap.parse_args()
    if args.profile:
        # The profiler sees the engine's kernels only when the engine core runs in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    global DEVICE
    DEVICE = args.device
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.tiny:
        model_dir = build_tiny(Path(args.work))
    else:
        model_dir = build(Path(args.work))
    if DEVICE == "cuda":
        # The build's tensors are gone but torch's allocator still holds their ~9 GB, which the
        # engine (sized as a share of the whole GPU) would find missing.
        torch.cuda.empty_cache()
    report = {
        "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE,
        "torch": torch.__version__,
        "build_s": round(time.perf_counter() - t0, 1),
    }
    default_batches = "1,4" if args.tiny else "1,8,32"
    batches = [int(b) for b in (args.batches or default_batches).split(",")]
    frames = args.frames or (6 if args.tiny else 48)
    run_vllm(args, model_dir, batches, frames, report, out)


def run_vllm(args, model_dir: Path, batches, frames, report: dict, out: Path) -> None:
    from talker_step_vllm import run

    samplings = args.samplings.split(",")
    path = out / "talker_step.json"
    save = lambda: path.write_text(json.dumps(report, indent=1))  # noqa: E731
    if args.profile:
        report["engine_in_process"] = True
    run(model_dir, DEVICE, batches, frames, samplings, args.eager, report, save, args.profile)
    print(vllm_table([(Path("talker_step.json"), report)]))


if __name__ == "__main__":
    main()
