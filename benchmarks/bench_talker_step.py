"""Qwen3-Omni's speech engines at full size on one GPU, without the server.

`--engine vllm` (the default): the talker as vLLM's model, stepped by vLLM's engine
(talker_step_vllm.py), its decode step time at batch 1, 8 and 32, greedy and with the
checkpoint's sampling, beside the step's memory-bandwidth floor (the bytes of weights it reads
over the H200's 4.8 TB/s) and their ratio.

`--engine torch`: the torch talker engine (talker/engine.py), eager and with CUDA graphs
(optionally an older `talker/` package too), and Code2Wav's audio per wall second.

    python3 benchmarks/bench_talker_step.py --work /dev/shm/talker-full --out OUT [--eager]
    python3 benchmarks/bench_talker_step.py --engine torch --work /dev/shm/talker-full --out OUT \
        [--baseline DIR --baseline-label TEXT]  # DIR holds an older `talker/` package (timed too)
    python3 benchmarks/bench_talker_step.py report OUT/talker_step.json [MORE.json] \
        --write BENCHMARKS.md  # the tables between <!-- talker-step:begin/end -->
    python3 benchmarks/bench_talker_step.py --device cpu --tiny --work DIR --out OUT
        # the vLLM path on the tiny checkpoint, small batches: a CPU dry run (< 1 min)

The checkpoint: the full-size talker, Code2Wav and the thinker's token embedding only (what the
engines load, ~8 GB), random bf16 weights (testing/full_qwen3_omni.py's config), and the
prefill embeddings of 8 chat prompts conditioned as the talker stage does (talker/prompt.py).
Every request runs `--frames` frames: the talker's end code is ignored (random weights would
end answers at random). One frame is 80 ms of audio, so a step time under 80 ms is faster than
real time for every request of the batch. Graphed and eager frames of the torch engine are
compared (same inputs, bf16): the fraction of equal frames is reported.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

FRAME_S = 0.08
BEGIN, END = "<!-- talker-step:begin -->", "<!-- talker-step:end -->"
DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


BUILT = ".built"  # written last: the folder holds a whole checkpoint in the hub's layout


def hub_experts(state: dict) -> dict:
    """transformers' 3-D expert tensors (`...mlp.experts.gate_up_proj` `[E, 2I, H]`,
    `down_proj` `[E, H, I]`) -> the hub's per-expert `...experts.N.{gate,up,down}_proj.weight`,
    the names vLLM's loader reads (and talker/runner.py merges back)."""
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


def build(work: Path, num_layers: int | None = None) -> Path:
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
    config = full.build_config(token_ids(tokenizer, full.SPECIALS), num_layers)
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

    write_prompts(work, config, talker, embedding)
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


def prompts(model_dir: Path, n: int) -> list[list[int]]:
    from vllm_omni_plugin.testing.qwen3_omni_reference import chat_input_ids

    return [chat_input_ids(model_dir, f"Tell me story number {i}.")[0].tolist() for i in range(n)]


def time_talker(engine, batch: int, frames: int, prompt_ids: list[list[int]]) -> dict:
    """`batch` requests at once, each `frames` frames; decode steps timed after the first two
    (the first prefills every request)."""
    engine.runner.eos = -1  # no end code: every request runs `frames` frames
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        text = torch.randint(0, 151000, (64,), generator=gen).tolist()
        engine.add_request(f"r{i}", prompt_ids[i % len(prompt_ids)], "ethan", frames)
        engine.add_text(f"r{i}", text, finished=True)
    codes: dict[str, list] = {f"r{i}": [] for i in range(batch)}
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        sync()
        times.append(time.perf_counter() - t0)
        for out in outs:
            codes[out.request_id].append(out.codes)
    steady = times[2:] or times
    step_ms = statistics.median(steady) * 1000
    return {
        "batch": batch,
        "frames": frames,
        "steps": len(times),
        "step_ms": round(step_ms, 2),
        "step_ms_p90": round(sorted(steady)[int(0.9 * (len(steady) - 1))] * 1000, 2),
        "first_steps_ms": [round(t * 1000, 1) for t in times[:2]],
        "rtf": round(step_ms / 1000 / FRAME_S, 4),
        "audio_s_per_wall_s": round(batch * FRAME_S / (step_ms / 1000), 2),
        "codes": {rid: torch.cat(c, 1) for rid, c in codes.items()},
    }


@torch.inference_mode()
def fused_vs_modules(runner, length: int = 48) -> dict:
    """One prefill's last hidden state through the runner's fused stack against transformers'
    own talker forward on the same weights, device and dtype (one step: no autoregressive
    drift), as max |difference| / max |reference|: with the GPU-only kernels the runner uses
    (vLLM's fused q/k-norm-rope and fused MoE, `runner.gpu_kernels`) and without them. bf16
    rounding alone gives ~1e-2; a wrong kernel, ~1."""
    hidden_size = runner.model.get_input_embeddings().weight.shape[1]
    gen = torch.Generator().manual_seed(7)
    prompt = (torch.randn(length, hidden_size, generator=gen) * 0.1).to(runner.device)
    prompt = prompt.to(runner.cache.keys.dtype)
    positions = torch.arange(length, device=runner.device)[None].expand(3, 1, -1)
    reference = runner.model(inputs_embeds=prompt[None], position_ids=positions, use_cache=False)
    expected = reference.last_hidden_state[0, -1].float()
    layers = runner.talker_layers + runner.predictor_layers
    chosen = [(layer.fused_qk_norm_rope, layer.fused_moe) for layer in layers]
    out = {}
    for name, gpu_kernels in (("as run", True), ("without GPU-only kernels", False)):
        if not gpu_kernels:
            for layer in layers:
                layer.fused_qk_norm_rope = layer.fused_moe = False
        slot = runner.cache.acquire()
        try:
            hidden, _ = runner.prefill([prompt], [slot])
        finally:
            runner.cache.release(slot)
        diff = (hidden[0].float() - expected).abs().max() / expected.abs().max()
        out[name] = round(float(diff), 5)
    for layer, (qk, moe) in zip(layers, chosen, strict=True):
        layer.fused_qk_norm_rope, layer.fused_moe = qk, moe
    return out


def time_code2wav(model_dir: Path, batch: int, frames: int) -> dict:
    """`batch` requests fed one frame each per step, as the talker streams them; timed on a
    second pass (the first loads each kernel and picks the convolutions' algorithms)."""
    from vllm_omni_plugin.code2wav import Code2WavEngine, Code2WavEngineConfig

    engine = Code2WavEngine(
        Code2WavEngineConfig(model=str(model_dir), device=DEVICE, dtype="bfloat16")
    )
    groups = engine.decoder.num_groups
    gen = torch.Generator().manual_seed(batch)

    def one_pass(tag: str) -> tuple[float, int]:
        samples = 0
        for i in range(batch):
            engine.add_request(f"{tag}{i}")
        t0 = time.perf_counter()
        for f in range(frames):
            for i in range(batch):
                codes = torch.randint(0, 2048, (groups, 1), generator=gen)
                engine.add_frames(f"{tag}{i}", codes, f == frames - 1)
            samples += sum(len(c.samples) for c in engine.step())
        while engine.has_unfinished():
            samples += sum(len(c.samples) for c in engine.step())
        sync()
        return time.perf_counter() - t0, samples

    first, _ = one_pass("warm")
    wall, samples = one_pass("r")
    audio_s = samples / 24000
    return {
        "batch": batch,
        "frames": frames,
        "first_pass_s": round(first, 3),
        "wall_s": round(wall, 3),
        "audio_s": round(audio_s, 3),
        "audio_s_per_wall_s": round(audio_s / wall, 2),
    }


def talker_engine(package: str, model_dir: Path, **kw):
    module = importlib.import_module(f"{package}.engine")
    return module.TalkerEngine(str(model_dir), DEVICE, "bfloat16", max_batch_size=64, **kw)


def vllm_table(runs: list[tuple[Path, dict]]) -> str:
    """The vLLM talker's rows (sampling, batch) beside their bandwidth floors."""
    lines = [
        "| talker on vLLM's engine, sampling | batch | frames each | step ms (median) | p90 "
        "| floor ms (weights read / 4.8 TB/s) | step / floor | weights read MB "
        "| of which routed experts MB | floor ms with KV reads | audio s per wall s "
        "| result file |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path, run in runs:
        for r in run.get("talker_vllm", ()):
            mb = r["weight_bytes"]
            lines.append(
                f"| {r['sampling']} | {r['batch']} | {r['frames']} | {r['step_ms']} "
                f"| {r['step_ms_p90']} | {r['floor_ms']} | {r['step_over_floor']} "
                f"| {mb['total'] / 1e6:.1f} | {mb['routed_experts'] / 1e6:.1f} "
                f"| {r['floor_with_kv_ms']} | {r['audio_s_per_wall_s']} | {path.name} |"
            )
    lines.append("")
    for path, run in runs:
        if "talker_vllm" in run:
            lines.append(
                f"- {path.name}: {run['device']}, torch {run['torch']}, vLLM {run['vllm']}, "
                f"{run['dtype']}, CUDA graphs: {run['cuda_graphs']}; engine load (s): "
                f"{run['load_s']}; checkpoint build (s): {run['build_s']}"
            )
    return "\n".join(lines) + "\n"


def report_table(paths: list[Path]) -> str:
    """Markdown from result files: the vLLM engine's table, then the torch engine's."""
    runs = [(p, json.loads(p.read_text())) for p in paths]
    parts = []
    if any("talker_vllm" in r for _, r in runs):
        parts.append(vllm_table(runs))
    if any("talker" in r for _, r in runs):
        parts.append(torch_table(runs))
    return "\n".join(parts)


def torch_table(runs: list[tuple[Path, dict]]) -> str:
    """The torch talker engine's rows (variant, batch), then Code2Wav's."""
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
    ap.add_argument("--engine", choices=("vllm", "torch"), default="vllm")
    ap.add_argument("--work", default="/dev/shm/talker-full")
    ap.add_argument("--out", required=True)
    ap.add_argument("--frames", type=int)
    ap.add_argument("--batches")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny checkpoint (a CPU dry run)")
    ap.add_argument("--eager", action="store_true", help="vllm: no CUDA graphs")
    ap.add_argument("--samplings", default="greedy,checkpoint", help="vllm: greedy, checkpoint")
    ap.add_argument("--baseline", help="torch: a folder holding an older talker package, `talker/`")
    ap.add_argument("--baseline-label", help="torch: the baseline's row name in the table")
    ap.add_argument("--num-layers", type=int, help="torch: every stack this deep (a CPU dry run)")
    ap.add_argument("--variants", default="eager,baseline,graphs", help="torch: what to time")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.tiny:
        model_dir = build_tiny(Path(args.work))
    else:
        model_dir = build(Path(args.work), args.num_layers)
    report = {
        "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE,
        "torch": torch.__version__,
        "build_s": round(time.perf_counter() - t0, 1),
    }
    default_batches = "1,4" if args.tiny else "1,8,32"
    batches = [int(b) for b in (args.batches or default_batches).split(",")]
    frames = args.frames or (6 if args.tiny else 48)
    if args.engine == "vllm":
        return run_vllm(args, model_dir, batches, frames, report, out)
    run_torch(args, model_dir, batches, frames, report, out)


def run_vllm(args, model_dir: Path, batches, frames, report: dict, out: Path) -> None:
    from talker_step_vllm import run

    samplings = args.samplings.split(",")
    path = out / "talker_step.json"
    save = lambda: path.write_text(json.dumps(report, indent=1))  # noqa: E731
    run(model_dir, DEVICE, batches, frames, samplings, args.eager, report, save)
    print(vllm_table([(Path("talker_step.json"), report)]))


def run_torch(args, model_dir: Path, batches, frames, report: dict, out: Path) -> None:
    report.update({"engine": "torch", "talker": [], "code2wav": []})
    if args.baseline_label:
        report["labels"] = {"baseline": args.baseline_label}
    ids = prompts(model_dir, 8)
    variants = [("eager", "vllm_omni_plugin.talker", {"enforce_eager": True})]
    if args.baseline:
        sys.path.insert(0, args.baseline)
        variants.append(("baseline", "talker", {}))
    variants.append(("graphs", "vllm_omni_plugin.talker", {}))
    variants = [v for v in variants if v[0] in args.variants.split(",")]
    codes = {}
    save = lambda: (out / "talker_step.json").write_text(json.dumps(report, indent=1))  # noqa: E731
    for name, package, kw in variants:
        try:
            t_load = time.perf_counter()
            engine = talker_engine(package, model_dir, **kw)
            report.setdefault("load_s", {})[name] = round(time.perf_counter() - t_load, 2)
            kernels = getattr(engine.runner, "gpu_kernels", None)
            report.setdefault("gpu_kernels", {})[name] = kernels
            if name == "graphs":
                report["fused_vs_modules"] = fused_vs_modules(engine.runner)
                print("fused stack vs transformers' modules:", report["fused_vs_modules"])
            for b in batches:
                row = time_talker(engine, b, frames, ids)
                codes[(name, b)] = row.pop("codes")
                row["variant"] = name
                print(json.dumps(row), flush=True)
                report["talker"].append(row)
                save()
        except Exception as exc:  # record it, time the other variants
            report.setdefault("errors", {})[name] = repr(exc)
            print(f"{name} failed: {exc!r}", flush=True)
        engine = None
        torch.cuda.empty_cache()
    for other in ("eager", "baseline"):
        for b in batches:
            if ("graphs", b) not in codes or (other, b) not in codes:
                continue
            g, e = codes[("graphs", b)], codes[(other, b)]
            equal = sum(int((g[r] == e[r]).all(0).sum()) for r in g)
            total = sum(g[r].shape[1] for r in g)
            report.setdefault(f"graphs_vs_{other}_equal_frames", {})[b] = f"{equal}/{total}"
    for b in batches:
        row = time_code2wav(model_dir, b, frames)
        print(json.dumps(row), flush=True)
        report["code2wav"].append(row)
    save()
    print("| variant | batch | step ms | p90 | rtf | audio s / wall s |")
    for row in report["talker"]:
        print(
            f"| {row['variant']} | {row['batch']} | {row['step_ms']} | {row['step_ms_p90']} | {row['rtf']} | {row['audio_s_per_wall_s']} |"
        )
    print("graphs vs eager, equal frames:", report.get("graphs_vs_eager_equal_frames"))
    print("graphs vs baseline, equal frames:", report.get("graphs_vs_baseline_equal_frames"))
    print("engine load (s, graphs: with their capture):", report.get("load_s"))
    print("vLLM's GPU-only kernels used:", report.get("gpu_kernels"))
    for row in report["code2wav"]:
        print(f"code2wav batch {row['batch']}: {row['audio_s_per_wall_s']} audio s / wall s")


if __name__ == "__main__":
    main()
