"""The BENCHMARKS.md table of `bench_omni_speech.py` runs, generated from results.jsonl (never
copied by hand): one row per figure, one column per system, each cell the median over that
system's runs (rounds) with the spread (min-max, n), then ours / theirs and the issue's goal.

    python benchmarks/omni_speech_report.py OUT/results.jsonl [MORE.jsonl ...]          # print
    python benchmarks/omni_speech_report.py OUT/results.jsonl --write BENCHMARKS.md     # replace
        # the block between `<!-- omni-speech:begin -->` and `<!-- omni-speech:end -->`
    python benchmarks/omni_speech_report.py B.jsonl --write BENCHMARKS.md --block NAME
        # another block, between `<!-- omni-speech NAME:begin -->` and its end (runs that must
        # not share medians with the first block's, e.g. after a change to the server)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fair_report import _stat, write_into  # noqa: E402

BEGIN, END = "<!-- omni-speech:begin -->", "<!-- omni-speech:end -->"


def markers(block: str | None = None) -> tuple[str, str]:
    """The BENCHMARKS.md markers of the main block, or of the block called `block`."""
    if block is None:
        return BEGIN, END
    return f"<!-- omni-speech {block}:begin -->", f"<!-- omni-speech {block}:end -->"


LABELS = {"ours": "vllm-omni-plugin", "omni": "vLLM-Omni 0.26"}


def _get(*keys):
    def read(run: dict):
        value = run
        for key in keys:
            value = (value or {}).get(key)
        return value

    return read


# (figure, how to read it from a run, goal on ours / theirs: (">=" or "<=", factor) or None)
FIGURES = [
    ("time to first audio, c1 (s)", _get("speech_c1", "ttfa_s"), ("<=", 0.8)),
    ("time to first audio, c8 (s)", _get("speech_c8", "ttfa_s"), ("<=", 0.8)),
    ("time to first audio, c32 (s)", _get("speech_c32", "ttfa_s"), None),
    ("real-time factor, c1", _get("speech_c1", "rtf"), ("<=", 1.0)),
    ("real-time factor, c8", _get("speech_c8", "rtf"), None),
    ("real-time factor, c32", _get("speech_c32", "rtf"), None),
    ("audio s per wall s, c32", _get("speech_c32", "audio_s_per_wall_s"), (">=", 1.2)),
    ("thinker tokens/s, decode (c1)", _get("text_c1", "decode_tokens_per_s"), None),
    ("thinker tokens/s, with first token (c1)", _get("text_c1", "tokens_per_s"), None),
    ("start-up to healthy (s)", _get("ready_s"), None),
    ("peak GPU memory (GiB)", _get("peak_gib"), None),
    ("GPU memory before start (GiB)", _get("baseline_gib"), None),
]


def load(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if rec.get("phase") == "omni-speech":
                    rows.append(rec)
    return rows


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _goal(ratio: float | None, goal) -> str:
    if goal is None:
        return ""
    op, factor = goal
    if ratio is None:
        return f"{op} {factor}x: not measured"
    met = ratio <= factor if op == "<=" else ratio >= factor
    return f"{op} {factor}x: {'met' if met else 'NOT met'}"


def _completion(runs: list[dict]) -> str:
    """Every load's completed/requests, 5xx and restarts, over all runs."""
    parts = []
    for key in sorted(
        {k for r in runs for k in r if k.startswith("speech_c")}, key=lambda k: int(k[8:])
    ):
        done = sum(r[key]["completed"] for r in runs if key in r)
        sent = sum(r[key]["requests"] for r in runs if key in r)
        parts.append(f"c{key[8:]} {done}/{sent}")
    fivexx = sum(r.get("http_5xx", 0) for r in runs)
    restarts = [r.get("stage_restarts") for r in runs]
    rs = "not exported" if all(x is None for x in restarts) else sum(x or 0 for x in restarts)
    return f"{', '.join(parts)}; 5xx {fivexx}; stage restarts {rs}"


def _lengths(runs: list[dict]) -> str:
    audio = [r[k]["audio_s"] for r in runs for k in r if k.startswith("speech_c")]
    at_cap = sum(r[k]["at_cap"] for r in runs for k in r if k.startswith("speech_c"))
    done = sum(r[k]["completed"] for r in runs for k in r if k.startswith("speech_c"))
    return f"audio per answer {_stat(audio)} s; {at_cap}/{done} answers at the frame cap"


def _first_outputs(runs: list[dict]) -> str | None:
    """Our stages' mean time from receiving a request to its first chunk at c1 (median over
    runs): where the first audio's time goes. None when no run recorded it."""
    per_stage: dict[str, list[float]] = {}
    for r in runs:
        for stage, s in (r.get("speech_c1", {}).get("stage_first_output_s") or {}).items():
            per_stage.setdefault(stage, []).append(s * 1000)
    if not per_stage:
        return None
    parts = [f"stage {k} {_stat(v)} ms" for k, v in sorted(per_stage.items())]
    return "first chunk out of each stage after it received the request, c1: " + ", ".join(parts)


def table(rows: list[dict]) -> str:
    if not rows:
        return "Not measured yet.\n"
    first = rows[0]
    systems = [s for s in LABELS if any(r["system"] == s for r in rows)]
    by = {s: [r for r in rows if r["system"] == s] for s in systems}
    devices = {s: by[s][0].get("device", "?") for s in systems}
    across = len(set(devices.values())) > 1
    where = (
        ", ".join(f"{LABELS[s]} on {d}" for s, d in devices.items())
        if across
        else first.get("device", "?")
    )
    shared = any(r.get("same_server_as") for r in rows)
    lengths = first["lengths"]
    lines = [
        f"Qwen3-Omni, {where}: {lengths['thinker_tokens']} thinker tokens, "
        f"at most {lengths['frames']} talker frames ({lengths['audio_s_at_cap']:.2f} s of audio) "
        "per answer, streamed pcm16. Each cell: median over runs (min-max, n runs); rounds "
        "alternate the systems, each round from a fresh start"
        + ("; the inputs of one round (text, audio, video) share its server." if shared else ".")
        + (" The systems ran on different GPUs: read the ratios as across GPUs." if across else ""),
        "",
        "| figure | " + " | ".join(LABELS[s] for s in systems) + " | ours / theirs | goal |",
        "|---" * (len(systems) + 3) + "|",
    ]
    for name, read, goal in FIGURES:
        cells = [_stat([read(r) for r in by[s]]) for s in systems]
        ratio = None
        if {"ours", "omni"} <= set(systems):
            mine, theirs = (
                _median([read(r) for r in by["ours"]]),
                _median([read(r) for r in by["omni"]]),
            )
            ratio = mine / theirs if mine is not None and theirs else None
        shown = f"{ratio:.2f}" if ratio is not None else "-"
        verdict = _goal(ratio, goal)
        if across and verdict:
            verdict += " (across GPUs)"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {shown} | {verdict} |")
    lines.append("")
    for s in systems:
        lines.append(
            f"- {LABELS[s]}: {_completion(by[s])}; {_lengths(by[s])}. Caps: {by[s][0]['caps']}."
        )
        first = _first_outputs(by[s])
        if first:
            lines.append(f"- {LABELS[s]}: {first} (0 thinker, 1 talker, 2 Code2Wav).")
    changes = next((r.get("changes") for r in rows if r["system"] == "omni"), None)
    if changes:
        lines += [
            "",
            "vLLM-Omni's qwen3_omni_moe.yaml, changed for one GPU and the fixed length:",
            "",
        ]
        lines += [f"- `{c['where']}`: {c['shipped']} -> {c['tuned']} ({c['why']})" for c in changes]
    return "\n".join(lines) + "\n"


QUESTIONS = {
    "audio": "a 10 s spoken question (an `input_audio` part) and a line of text",
    "video": "a 30-frame video question (a `video_url` MP4, 320 x 240) and a line of text",
    "audio-new": "a 10 s spoken question the server has not heard before (a new recording "
    "with each request) and a line of text",
    "video-new": "a 30-frame video question the server has not seen before (a new clip with "
    "each request) and a line of text",
}


def tables(rows: list[dict]) -> str:
    """The text-question table (unless only media questions were measured), then one per
    media question kind that was measured."""
    text = [r for r in rows if r.get("input", "text") == "text"]
    out = [table(text)] if text or not rows else []
    for kind, what in QUESTIONS.items():
        mine = [r for r in rows if r.get("input") == kind]
        if mine:
            out.append(f"\nSpeech answers to {what}:\n\n" + table(mine))
    return "".join(out).lstrip("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--write", type=Path, default=None, help="markdown file with the markers")
    parser.add_argument("--block", default=None, help="the name of another block to write")
    args = parser.parse_args()
    text = tables(load(args.results))
    if args.write:
        write_into(args.write, text, *markers(args.block))
    else:
        print(text)


if __name__ == "__main__":
    main()
