"""Markdown from the GPU checks of the speech stages' parts: Code2Wav's batched decode
(code2wav_gpu_check.py) and the talker's code predictor (talker_predictor_gpu_check.py).

    python3 benchmarks/speech_parts_report.py RESULT.json... [--write BENCHMARKS.md]

Each file is recognised by its keys; `--write` replaces the block between the markers below.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BEGIN = "<!-- speech-parts:begin -->"
END = "<!-- speech-parts:end -->"


def code2wav_table(path: Path, run: dict) -> list[str]:
    lines = [
        f"Code2Wav, {run['device']}, torch {run['torch']} ({path.name}): one call decodes a "
        "chunk per request; eager vs CUDA graphs at the chunk shapes.",
        "",
        "| weights | window, new frames | batch | eager ms / call | graphs ms / call | speed-up "
        "| audio s per wall s (graphs) | max abs diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name in ("tiny", "full_size_random", "model"):
        part = run.get(name)
        if part is None:
            continue
        for r in part["rows"]:
            lines.append(
                f"| {name} ({part['dtype']}) | {r['window']}, {r['new_frames']} | {r['batch']} "
                f"| {r['eager_ms_per_call']} | {r['graphs_ms_per_call']} "
                f"| {r['eager_ms_per_call'] / r['graphs_ms_per_call']:.2f}x "
                f"| {r['graphs_audio_s_per_wall_s']} | {r['max_abs_diff']} |"
            )
        notes.append(
            f"- {name}: {part['graphs']} graphs captured in {part['capture_s']} s, "
            f"{part['graph_memory_gib']} GiB for graphs, peak {part['peak_memory_gib']} GiB"
        )
    return [*lines, "", *notes, ""]


def predictor_table(path: Path, run: dict) -> list[str]:
    lines = [
        f"The talker's code predictor (all sub-steps and sampling of one talker step), tiny "
        f"checkpoint, {run['device']}, vLLM {run['vllm']}, {run['dtype']} ({path.name}):",
        "",
        "| batch | eager ms | graphs ms | speed-up |",
        "|---|---|---|---|",
    ]
    for r in run["predictor_ms"]:
        lines.append(
            f"| {r['rows']} | {r['eager_ms']} | {r['graphed_ms']} "
            f"| {r['eager_ms'] / r['graphed_ms']:.1f}x |"
        )
    paths_equal = all(all(v for k, v in p.items() if k.endswith("_equal")) for p in run["paths"])
    frames = run["frames"]
    frames_equal = all(
        f["greedy_equal"] and f["seeded_graphs_equal_eager"] and f["seeded_reproducible"]
        for f in frames.values()
    )
    lines += [
        "",
        f"- graphed codes equal the eager path's at every bucket (greedy and mixed rows, padded "
        f"buckets too): {paths_equal}",
        f"- engine frames, graphs vs eager predictor ({', '.join(frames)}): greedy equal, seeded "
        f"equal and reproducible: {frames_equal}; another seed differs: "
        f"{all(f['other_seed_differs'] for f in frames.values())}",
    ]
    compiled = run.get("compiled_layers")
    if compiled:
        # The graphs hold the compiled layers; "eager" above is the same compiled layers
        # launched op by op outside the graphs.
        diff = max(r["hidden_max_abs_diff"] for r in compiled)
        equal = all(r["greedy_codes_equal"] for r in compiled)
        lines.append(
            f"- the predictor's layers compiled (in and out of the graphs) vs their torch ops, "
            f"batch {', '.join(str(r['rows']) for r in compiled)}: largest hidden-state "
            f"difference {diff:g}, greedy codes equal: {equal}"
        )
    eager = run.get("eager_engine")
    if eager:
        lines.append(
            f"- an `enforce_eager` engine (start {eager['start_s']} s vs "
            f"{run['graphed_engine_start_s']} s graphed): greedy frames equal the graphed "
            f"engine's: {eager['greedy_frames_equal_graphed_engine']} (vLLM's compiled graphs "
            "round bf16 differently from eager kernels)"
        )
    return [*lines, ""]


def report(paths: list[Path]) -> str:
    out: list[str] = []
    for path in paths:
        run = json.loads(path.read_text())
        if "predictor_ms" in run:
            out += predictor_table(path, run)
        elif "full_size_random" in run or "tiny" in run:
            out += code2wav_table(path, run)
        else:
            raise ValueError(f"{path}: neither a Code2Wav nor a code predictor result")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, nargs="+")
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    text = report(args.results)
    if args.write:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from fair_report import write_into

        write_into(args.write, text, BEGIN, END)
    else:
        print(text)


if __name__ == "__main__":
    main()
