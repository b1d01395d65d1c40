"""The Qwen3-Omni speech benchmark's parts that need no server (the served measurement is in
tests/serving/test_qwen3_omni_serve.py): vLLM-Omni's own qwen3_omni_moe.yaml (0.26, the fixture
copied from its wheel) moved to one GPU and capped, written and parsed back; our side's caps;
both servers' streamed chunk shapes through the openai client's own types; the run plan (rounds
alternate, recorded runs are not repeated); the report's medians, ratios and goals."""

from __future__ import annotations

import base64
import copy
import json
import sys
from pathlib import Path

import pytest
import yaml
from openai.types.chat import ChatCompletionChunk

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_omni_speech as bench  # noqa: E402
import incumbent  # noqa: E402
import omni_speech_client as client  # noqa: E402
import omni_speech_report as report  # noqa: E402

SHIPPED = REPO / "tests" / "config" / "fixtures" / "vo26_qwen3_omni_moe.yaml"


def test_incumbent_deploy_on_one_gpu_is_written_valid_and_otherwise_as_shipped(tmp_path):
    shipped = yaml.safe_load(SHIPPED.read_text())
    info = bench.write_incumbent(tmp_path, None, SHIPPED, frames=128)
    written = yaml.safe_load(Path(info["deploy"]).read_text())
    assert [s["devices"] for s in written["stages"]] == ["0", "0", "0"]
    shares = [s["gpu_memory_utilization"] for s in written["stages"]]
    assert shares == [0.6, 0.2, 0.1] and sum(shares) <= 0.95
    talker = written["stages"][1]["default_sampling_params"]
    assert talker == {**shipped["stages"][1]["default_sampling_params"], "max_tokens": 129}
    # Everything not listed as a change is as shipped (platform sections, connectors, sampling).
    undone = copy.deepcopy(written)
    for change in info["changes"]:
        where = change["where"].split()
        stage = undone["stages"][int(where[1])]
        if where[2] == "max_tokens":
            stage["default_sampling_params"]["max_tokens"] = change["shipped"]
        else:
            stage[where[2]] = change["shipped"]
    assert undone == shipped
    assert {c["where"] for c in info["changes"]} == {
        "stage 0 gpu_memory_utilization", "stage 1 devices", "stage 1 gpu_memory_utilization",
        "stage 2 devices", "stage 1 max_tokens",
    }  # fmt: skip
    assert info["reserved"]["shares"] == {"stage_0": 0.6, "stage_1": 0.2, "stage_2": 0.1}
    assert incumbent.validate_deploy(written) == []
    with pytest.raises(ValueError, match="frames"):
        incumbent.qwen3_omni_one_gpu_deploy(shipped, 0)
    crowded, _ = incumbent.qwen3_omni_one_gpu_deploy(shipped, 8, {0: 0.9, 1: 0.6, 2: 0.1})
    assert any("sums to 1.60" in p for p in incumbent.validate_deploy(crowded))


def test_incumbent_fit_for_80gb_changes_only_memory_and_lengths(tmp_path):
    info = bench.write_incumbent(tmp_path, None, SHIPPED, frames=128, fit="80gb")
    written = yaml.safe_load(Path(info["deploy"]).read_text())
    assert info["fit"] == "80gb" and incumbent.validate_deploy(written) == []
    shares = [s["gpu_memory_utilization"] for s in written["stages"]]
    assert shares == [0.79, 0.105, 0.05]
    thinker, talker, _ = written["stages"]
    assert (thinker["max_model_len"], thinker["max_num_batched_tokens"]) == (4096, 4096)
    assert (talker["max_model_len"], talker["max_num_batched_tokens"]) == (4096, 4096)
    assert {c["where"] for c in info["changes"]} == {
        "stage 0 gpu_memory_utilization", "stage 1 devices", "stage 1 gpu_memory_utilization",
        "stage 2 devices", "stage 2 gpu_memory_utilization", "stage 1 max_tokens",
        "stage 0 max_model_len", "stage 0 max_num_batched_tokens",
        "stage 1 max_model_len", "stage 1 max_num_batched_tokens",
    }  # fmt: skip
    # The H200's form by default and wherever the GPU's memory is unknown.
    assert bench.incumbent_fit("auto", 79.6) == "80gb"
    assert bench.incumbent_fit("auto", 139.8) == "h200"
    assert bench.incumbent_fit("auto", None) == "h200"
    assert bench.incumbent_fit("h200", 79.6) == "h200"


def test_ours_caps_the_talker_through_stage_overrides():
    over = bench.ours_overrides(128, '{"1": {"default_sampling_params": {"temperature": 0}}}')
    fixed = {"max_tokens": 128, "min_tokens": 128, "temperature": 0}
    assert over == {"1": {"default_sampling_params": fixed}}
    reserved = bench.ours_reserved(bench.ours_overrides(96))  # qwen3_omni_1gpu, resolved
    assert reserved["talker_max_tokens"] == 96
    assert reserved["shares"]["stage_0"] == 0.75


def _chunk(delta: dict, **extra) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate(
        {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
         "choices": [{"index": 0, "delta": delta, "finish_reason": None}], **extra}
    )  # fmt: skip


def test_audio_pieces_from_both_servers_stream_shapes():
    pcm = (b"\x01\x00" * 1920)[:3840]
    b64 = base64.b64encode(pcm).decode()
    assert client.audio_piece(_chunk({"audio": {"id": "a", "data": b64}})) == (pcm, "")
    assert client.audio_piece(_chunk({"audio": {"id": "a", "transcript": "hi"}})) == (b"", "hi")
    # vLLM-Omni 0.26: a top-level `modality`, the audio's base64 in delta.content
    assert client.audio_piece(_chunk({"content": b64}, modality="audio")) == (pcm, "")
    assert client.audio_piece(_chunk({"content": "hi"}, modality="text")) == (b"", "hi")
    empty = ChatCompletionChunk.model_validate(
        {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": []}
    )
    assert client.audio_piece(empty) == (b"", "")
    assert client.Lengths(64, 128).audio_s == 10.24


def test_stage_restarts_from_metrics_text():
    text = (
        'omni_stage_restarts_total{pipeline="qwen3_omni",stage_id="0",kind="ar"} 0.0\n'
        'omni_stage_restarts_total{pipeline="qwen3_omni",stage_id="1",kind="x"} 2.0\n'
        "omni_stage_restarts_created 1.7e9\n"
    )
    assert client.stage_restarts(text) == 2
    assert client.stage_counter(text, "restarts") == {"0": 0.0, "1": 2.0}
    assert client.stage_restarts("vllm:num_requests_running 0\n") is None
    first = (
        'omni_stage_time_to_first_output_seconds_count{pipeline="p",stage_id="1",kind="ar"} 4.0\n'
        'omni_stage_time_to_first_output_seconds_sum{pipeline="p",stage_id="1",kind="ar"} 0.2\n'
    )
    assert client.stage_first_outputs(first) == {"1": (0.2, 4.0)}
    assert client.stage_first_outputs(text) is None


def test_plan_alternates_and_skips_recorded_runs():
    systems = ["ours", "omni"]
    assert bench.plan(systems, 2, []) == [(0, "ours"), (0, "omni"), (1, "ours"), (1, "omni")]
    done = [{"round": 0, "system": "ours", "run_s": 200.0}]
    assert bench.plan(systems, 2, done) == [(0, "omni"), (1, "ours"), (1, "omni")]
    assert bench.estimate_s("ours", done, 300) == 220.0
    done.append({"round": 1, "system": "ours", "run_s": 100.0})  # warm caches: the latest
    assert bench.estimate_s("ours", done, 300) == 110.0
    assert bench.estimate_s("omni", done, 300) == 300
    # A later run continues the rounds: ROUND_OFFSET=2 ROUNDS=1 runs round 2 only.
    assert bench.plan(systems, 1, done, offset=2) == [(2, "ours"), (2, "omni")]


def test_then_measures_more_inputs_on_the_same_server_and_refuses_unknown_ones():
    assert bench.then_arg("audio:1,8") == ("audio", [1, 8])
    assert bench.then_arg("video") == ("video", [1])
    with pytest.raises(Exception, match="INPUT:LEVELS"):
        bench.then_arg("speech:1")
    with pytest.raises(Exception, match="levels must be"):
        bench.then_arg("audio:0")


def _speech(ttfa, rtf, per_wall, completed=8):
    return {"ttfa_s": ttfa, "rtf": rtf, "audio_s_per_wall_s": per_wall, "completed": completed,
            "requests": 8, "audio_s": 10.24, "at_cap": completed}  # fmt: skip


def _run(system, r, ttfa, per_wall, **extra):
    data = {
        "ready_s": 100.0, "peak_gib": 120.0, "baseline_gib": 0.5, "http_5xx": 0,
        "stage_restarts": 0 if system == "ours" else None,
        "text_c1": {"decode_tokens_per_s": 150.0, "tokens_per_s": 100.0},
        "speech_c1": _speech(ttfa, 0.2, 5.0), "speech_c8": _speech(ttfa * 2, 0.3, 25.0),
        "speech_c32": _speech(ttfa * 4, 0.5, per_wall),
    }  # fmt: skip
    lengths = client.Lengths(64, 128)
    return bench.build_record(system, r, "NVIDIA H200", lengths, 300.0, {**data, **extra})


def test_report_medians_ratios_and_goals(tmp_path):
    rows = [_run("ours", r, t, 60.0) for r, t in enumerate([0.3, 0.4, 0.5])]
    change = {"where": "stage 1 devices", "shipped": "1", "tuned": "0", "why": "one GPU"}
    rows += [_run("omni", r, 0.6, 40.0, changes=[change]) for r in range(3)]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"phase": "fair"}\n')
    text = report.table(report.load([results]))
    line = next(x for x in text.splitlines() if x.startswith("| time to first audio, c1"))
    assert line == (
        "| time to first audio, c1 (s) | 0.40 (0.30-0.50, n=3) | 0.60 (0.60-0.60, n=3) | 0.67 "
        "| <= 0.8x: met |"
    )
    line = next(x for x in text.splitlines() if x.startswith("| audio s per wall s, c32"))
    assert line.endswith("| 1.50 | >= 1.2x: met |")
    line = next(x for x in text.splitlines() if x.startswith("| real-time factor, c1"))
    assert line.endswith("| 1.00 | <= 1.0x: met |")
    assert (
        "vLLM-Omni 0.26: c1 24/24, c8 24/24, c32 24/24; 5xx 0; stage restarts not exported" in text
    )
    assert "`stage 1 devices`: 1 -> 0 (one GPU)" in text
    assert "64 thinker tokens, at most 128 talker frames (10.24 s of audio)" in text
    assert "first chunk out of each stage" not in text  # no run recorded the stages' times
    stages = {"0": 0.025, "1": 0.06, "2": 0.09}
    timed = [_run("ours", 0, 0.3, 60.0), _run("ours", 1, 0.4, 60.0)]
    for run, scale in zip(timed, (1.0, 2.0), strict=True):
        run["speech_c1"]["stage_first_output_s"] = {k: v * scale for k, v in stages.items()}
    assert (
        "vllm-omni-plugin: first chunk out of each stage after it received the request, c1: "
        "stage 0 37.50 (25.00-50.00, n=2) ms, stage 1 90.00 (60.00-120.00, n=2) ms, "
        "stage 2 135.00 (90.00-180.00, n=2) ms (0 thinker, 1 talker, 2 Code2Wav)."
    ) in report.table(timed)
    slow = [_run("ours", 0, 0.7, 30.0), _run("omni", 0, 0.6, 40.0)]
    text = report.table(slow)
    assert "| 1.17 | <= 0.8x: NOT met |" in text and "| 0.75 | >= 1.2x: NOT met |" in text
    assert report.table([]) == "Not measured yet.\n"


def test_media_questions_are_bounded_valid_media_and_runs_keep_apart_by_input(tmp_path):
    """The audio question is 10 s of 16 kHz WAV, the video question 30 frames of 320 x 240 (read
    back by the server's own bound checks), the same each request or new each request; runs of one input kind never count as done for
    another, and the report gives each measured kind its own table."""
    import io
    import wave

    from vllm_omni_plugin.serving.media_limits import container_video

    audio, text = client.user_content(0, "audio")
    raw = base64.b64decode(audio["input_audio"]["data"])
    with wave.open(io.BytesIO(raw)) as w:
        assert (w.getframerate(), w.getnframes()) == (16000, 160000)
    assert text["type"] == "text"
    video, _ = client.user_content(3, "video")
    url = video["video_url"]["url"]
    assert url.startswith("data:video/mp4;base64,")
    assert container_video(base64.b64decode(url.split(",", 1)[1])) == (30, 320, 240)
    assert client.user_content(2, "text") == client.PROMPTS[2]
    # `*-new`: a recording or clip no earlier request sent, of the same size; the plain kinds
    # repeat theirs.
    assert client.user_content(1, "video") == [video, _]
    fresh = [client.user_content(0, "video-new")[0]["video_url"]["url"] for _ in range(2)]
    assert len({url, *fresh}) == 3
    assert container_video(base64.b64decode(fresh[1].split(",", 1)[1])) == (30, 320, 240)
    heard = [client.user_content(0, "audio-new")[0]["input_audio"]["data"] for _ in range(2)]
    assert len({audio["input_audio"]["data"], *heard}) == 3
    with wave.open(io.BytesIO(base64.b64decode(heard[0]))) as w:
        assert (w.getframerate(), w.getnframes()) == (16000, 160000)
    with pytest.raises(ValueError, match="input 'speech'"):
        client.user_content(0, "speech")

    audio_run = {**_run("ours", 0, 0.3, 60.0), "input": "audio"}
    text_run = _run("ours", 0, 0.4, 60.0)
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(audio_run) + "\n" + json.dumps(text_run) + "\n")
    assert [r["input"] for r in bench.done_runs(results, "audio")] == ["audio"]
    assert bench.done_runs(results, "video") == []
    assert len(bench.done_runs(results)) == 1  # the text run (recorded before `input` existed)
    text = report.tables(report.load([results]))
    assert text.count("| time to first audio, c1 (s) |") == 2
    assert "Speech answers to a 10 s spoken question" in text
    assert "video question" not in text


def test_served_parity_locates_where_the_waveforms_part_and_its_overrides_load():
    import numpy as np
    import omni_served_parity as parity

    from vllm_omni_plugin.config.resolve import load_deploy_config

    ref = np.zeros(5 * parity.SAMPLES_PER_FRAME, dtype=np.float32)
    served = ref.copy()
    assert parity.compare_waves(served, ref)["first_frame_over_bound"] is None
    served[3 * parity.SAMPLES_PER_FRAME + 7] = 0.02  # inside frame 3
    got = parity.compare_waves(served[:-5], ref)
    assert got["first_frame_over_bound"] == 3 and got["max_abs"] == pytest.approx(0.02)
    assert got["served_samples"] == len(ref) - 5
    # The GPU file takes the tiny checkpoint's overrides (a key it refused would fail here).
    cfg = load_deploy_config(
        "qwen3_omni_1gpu", stage_overrides=json.dumps(parity.overrides("bfloat16", gpu=True))
    )
    assert cfg.stage(1).sampling.max_tokens == parity.FRAMES
    assert cfg.stage(0).flat_dict()["gpu_memory_utilization"] == 0.2
    # vLLM refuses a talker context past the checkpoint's positions.
    from vllm_omni_plugin.pipelines.qwen3_omni import talker_lengths
    from vllm_omni_plugin.testing import tiny_qwen3_omni as tiny

    talker_positions = tiny.build_config().talker_config.text_config.max_position_embeddings
    assert talker_lengths(cfg.stage(1))[0] <= talker_positions


def test_talker_step_report_names_the_baseline_and_what_ran(tmp_path):
    """bench_talker_step.py's table of result files from the torch talker engine it timed
    before the talker ran on vLLM's engine: a run's own baseline label, its graphed-vs-baseline
    frame agreement and whether the q/k norms and rope ran as one kernel, per result file; the
    committed results of such runs still print."""
    import bench_talker_step

    row = {"batch": 1, "frames": 48, "step_ms": 9.5, "step_ms_p90": 9.9, "rtf": 0.12}
    run = {
        "device": "NVIDIA H200",
        "torch": "2.11.0",
        "talker": [
            {**row, "variant": "baseline", "step_ms": 17.4, "audio_s_per_wall_s": 4.6},
            {**row, "variant": "graphs", "audio_s_per_wall_s": 8.4},
        ],
        "code2wav": [{"batch": 1, "audio_s_per_wall_s": 90.0}],
        "labels": {"baseline": "unfused (63be752)"},
        "load_s": {"graphs": 12.0},
        "graphs_vs_baseline_equal_frames": {"1": "40/48"},
        "gpu_kernels": {
            "graphs": {"fused_qk_norm_rope": True, "fused_moe": True},
            "baseline": None,
        },
    }
    path = tmp_path / "talker_step.json"
    path.write_text(json.dumps(run))
    table = bench_talker_step.report_table([path])
    assert "| unfused (63be752) | 1 | 48 | 17.4 |" in table
    assert "| slot cache + CUDA graphs | 1 | 48 | 9.5 |" in table
    assert "graphed frames equal to the baseline's (bf16): {'1': '40/48'}" in table
    assert (
        "vLLM's GPU-only kernels used: {'graphs': {'fused_qk_norm_rope': True, 'fused_moe': True}"
        in table
    )
    committed = REPO / "benchmarks/results/talker_step_h200_2026-12-03.json"
    table = bench_talker_step.report_table([committed])
    assert (
        f"| slot cache, eager | 1 | 48 | 146.76 | 150.78 | 1.8345 | 0.55 | {committed.name} |"
        in (table)
    )


def _block(doc: str, begin: str, end: str) -> str:
    return doc.split(begin, 1)[1].split(end, 1)[0].strip()


def test_benchmarks_md_speech_tables_are_what_the_results_files_give():
    """BENCHMARKS.md's talker-step, speech-parts and served-speech blocks are the reports of the
    results files they name (regenerated here and compared as text): no hand-edited figure."""
    import bench_talker_step
    import speech_parts_report

    doc = (REPO / "BENCHMARKS.md").read_text()
    results = REPO / "benchmarks" / "results"
    step = bench_talker_step.report_table(
        [
            results / "talker_step_vllm_h100_compiled_2026-12-06.json",
            results / "talker_step_vllm_h200_2026-12-05.json",
            results / "talker_step_vllm_h100_2026-12-06.json",
            results / "talker_profile_h100_2026-12-06.json",
            results / "talker_profile_h100_compiled_2026-12-06.json",
            results / "talker_step_h200_2026-12-03.json",
            results / "talker_step_h200_2026-12-03_growth.json",
        ]
    )
    assert _block(doc, bench_talker_step.BEGIN, bench_talker_step.END) == step.strip()
    parts = speech_parts_report.report(
        [
            results / "code2wav_gpu_h200_2026-12-05.json",
            results / "code2wav_gpu_h100_2026-12-06.json",
            results / "talker_predictor_gpu_h200_2026-12-05.json",
            results / "talker_predictor_gpu_h100_2026-12-06.json",
        ]
    )
    assert "| full_size_random (bfloat16) | 50, 25 | 32 |" in parts
    assert _block(doc, speech_parts_report.BEGIN, speech_parts_report.END) == parts.strip()
    served = report.tables(
        report.load(
            [
                results / "omni_speech_h100_2026-12-07_warmed.jsonl",
                results / "omni_speech_h200_2026-12-04_incumbent.jsonl",
                results / "omni_speech_h100_2026-12-07_media.jsonl",
            ]
        )
    )
    assert "vllm-omni-plugin on NVIDIA H100 80GB HBM3, vLLM-Omni 0.26 on NVIDIA H200" in served
    assert _block(doc, report.BEGIN, report.END) == served.strip()
    # Runs after the front end's processed-media cache: a block of their own, not pooled with
    # the rounds before it.
    cached = report.tables(report.load([results / "omni_speech_h100_2026-12-07_media_cache.jsonl"]))
    assert "a new clip with each request" in cached and "Not measured yet" not in cached
    assert _block(doc, *report.markers("media-cache")) == cached.strip()
    # Runs after the talker's prompt was cut to its ids and grids: another block of their own.
    prompt_only = report.tables(
        report.load([results / "omni_speech_h100_2026-12-07_talker_prompt.jsonl"])
    )
    assert "a new clip with each request" in prompt_only
    assert _block(doc, *report.markers("talker-prompt")) == prompt_only.strip()
