"""The fair benchmark harness's parts that need no GPU: steady load (closed and open loop) against
a real local HTTP server through the official openai client, latency percentiles, the split
each system reports, the incumbent's shipped and tuned deploy files, and the report tables."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import fair_report  # noqa: E402
import incumbent  # noqa: E402
import load_gen  # noqa: E402

# vLLM-Omni 0.26's glm_image.yaml, the fields the harness reads and changes (its file ships
# in the vllm-omni wheel; the GPU runs read it from there).
SHIPPED_GLM = {
    "async_chunk": False,
    "stages": [
        {
            "stage_id": 0,
            "max_num_seqs": 1,
            "gpu_memory_utilization": 0.6,
            "enforce_eager": False,
            "trust_remote_code": True,
            "enable_prefix_caching": False,
            "max_num_batched_tokens": 32768,
            "devices": "0",
            "default_sampling_params": {"temperature": 0.9, "max_tokens": 4353},
        },
        {
            "stage_id": 1,
            "max_num_batched_tokens": 32768,
            "max_num_seqs": 1,
            "enforce_eager": True,
            "trust_remote_code": True,
            "enable_prefix_caching": False,
            "devices": "1",
            "default_sampling_params": {"num_inference_steps": 50},
        },
    ],
}


def test_percentile_matches_numpy_linear():
    import numpy as np

    values = sorted([3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.3])
    for q in (0, 50, 90, 99, 100):
        assert load_gen.percentile(values, q) == pytest.approx(np.percentile(values, q))
    with pytest.raises(ValueError):
        load_gen.percentile([], 50)


def test_arrival_times_are_seeded_poisson():
    times = load_gen.arrival_times(2000, rate_per_s=4.0, seed=3)
    assert times[0] == 0 and times == sorted(times)
    assert times == load_gen.arrival_times(2000, 4.0, 3)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)  # mean gap 1 / rate


class _SlowImages(BaseHTTPRequestHandler):
    """POST /v1/images/generations: waits `delay` s, answers in vLLM-Omni's body shape (its
    `metrics.stage_durations`) and counts how many requests are in flight at once."""

    delay = 0.2
    lock = threading.Lock()
    active = 0
    peak = 0

    def do_POST(self):  # noqa: N802 (http.server's name)
        cls = type(self)
        self.rfile.read(int(self.headers["content-length"]))
        with cls.lock:
            cls.active += 1
            cls.peak = max(cls.peak, cls.active)
        time.sleep(cls.delay)
        with cls.lock:
            cls.active -= 1
        body = json.dumps(
            {
                "created": 0,
                "data": [{"b64_json": "aGk="}],
                "metrics": {
                    "stage_durations": {"stage_0_gen_ms": 150.0, "denoise": 0.12},
                    "peak_memory_mb": 10.0,
                },
            }
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def slow_server():
    _SlowImages.active = _SlowImages.peak = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowImages)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _sender(url: str):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    async def send(i: int) -> dict:
        t0 = time.perf_counter()
        raw = await client.images.with_raw_response.generate(prompt=f"p{i}", n=1)
        took = time.perf_counter() - t0
        return {
            "s": took,
            "split_s": load_gen.split_from_response(raw.headers, raw.http_response.json()),
        }

    return send


def test_closed_loop_keeps_concurrency_in_flight(slow_server):
    """8 requests through 2 workers take 4 rounds of 0.2 s, never more than 2 in flight; the
    incumbent-shaped split is read from each response body (ms keys to seconds)."""
    result = asyncio.run(load_gen.closed_loop(_sender(slow_server), requests=8, concurrency=2))
    summary = result.summary()
    assert summary["completed"] == 8 and _SlowImages.peak == 2
    assert 0.75 < result.wall_s < 2.0
    assert summary["images_per_min"] == pytest.approx(8 * 60 / result.wall_s, rel=1e-3)
    assert 0.2 <= summary["p50_s"] <= summary["p99_s"]
    assert summary["split_median_s"] == {"denoise": 0.12, "stage_0_gen": 0.15}


def test_open_loop_sends_at_arrival_times(slow_server):
    """At 20 requests/s with a 0.2 s service, arrivals overlap: more than 2 are in flight."""
    result = asyncio.run(load_gen.open_loop(_sender(slow_server), 12, rate_per_s=20.0, seed=1))
    assert result.summary()["completed"] == 12 and _SlowImages.peak > 2
    assert result.summary()["rate_per_s"] == 20.0


def test_split_from_our_header():
    # The AR stage's ttft / tpot are inside stage_0's time: not more of the split.
    headers = {
        "x-omni-stage-timings": '{"stage_0":1200.5,"stage_0_ttft":20.0,"stage_0_tpot":6.5,'
        '"decode":30.0,"other":4.0}'
    }
    assert load_gen.split_from_response(headers, {}) == {
        "stage_0": 1.2005,
        "decode": 0.03,
        "other": 0.004,
    }
    assert load_gen.split_from_response({}, {"data": []}) == {}


def test_glm_deploys_shipped_and_tuned(tmp_path):
    """The tuned file changes exactly AR batch and share (to ours) and the DiT's eager flag; both
    files validate; an unknown key or a second GPU is refused."""
    from vllm_omni_plugin.config.resolve import load_deploy_config

    shipped, base = incumbent.shipped_glm_deploy(SHIPPED_GLM, 1024, "x.Proc")
    assert {c.where for c in base} == {
        "stage 1 devices",
        "stage 0 max_tokens",
        "stage 0 logits_processors",
    }
    assert (
        shipped["stages"][0]["default_sampling_params"]["max_tokens"] == 1281
    )  # the 1024x1024 grid + EOS
    ours = {"stages": [s.flat_dict() for s in load_deploy_config("glm_image_1gpu").stages]}
    tuned, changes = incumbent.tuned_glm_deploy(shipped, ours)
    assert [(c.where, c.shipped, c.tuned) for c in changes] == [
        ("stage 0 max_num_seqs", 1, 8),
        ("stage 0 gpu_memory_utilization", 0.6, 0.35),
        ("stage 1 enforce_eager", True, False),
    ]
    for cfg in (shipped, tuned):
        assert incumbent.validate_deploy(cfg) == []
    written = incumbent.write_deploys(tmp_path, shipped, tuned, changes)
    assert yaml.safe_load(Path(written["tuned"]).read_text()) == tuned
    assert incumbent.reserved_share(tuned) == {"stage_0": 0.35, "stage_1": None}

    bad = json.loads(json.dumps(tuned))
    bad["stages"][0]["max_num_seq"] = 8
    bad["stages"][1]["devices"] = "1"
    problems = incumbent.validate_deploy(bad)
    assert any("unknown key 'max_num_seq'" in p for p in problems)
    assert any("expected GPU 0" in p for p in problems)


def test_qwen_image_incumbent_argv():
    argv, changes = incumbent.qwen_image_argv("/m", tuned=True, batch=8)
    assert argv == ["/m", "--omni", "--step-execution", "--max-num-seqs", "8"]
    assert [c.where for c in changes] == ["--step-execution", "--max-num-seqs"]
    assert incumbent.qwen_image_argv("/m", tuned=False, batch=8) == (["/m", "--omni"], [])


def _run(system, r, ipm, c1, **extra):
    return {
        "phase": "fair", "family": "qwen-image", "system": system, "round": r, "device": "GPU",
        "size": 1024, "steps": 50, "c1_s": c1, "c1_split_s": [{"stage_0": c1}],
        "closed": {"images_per_min": ipm, "p50_s": 1.0, "p99_s": 2.0, "requests": 32, "concurrency": 8},
        "peak_gib": 60.0, "baseline_gib": 0.5, "reserved": {"shares": {"stage_0": 0.9}, "gib": 126.0},
        **extra,
    }  # fmt: skip


def test_report_medians_spreads_and_write(tmp_path):
    rows = [_run("ours", r, ipm, 10.0) for r, ipm in enumerate([4.0, 5.0, 6.0])]
    rows += [
        _run(
            "omni-tuned",
            0,
            3.0,
            12.0,
            changes=[{"where": "--step-execution", "shipped": False, "tuned": True, "why": "w"}],
        )
    ]
    rows += [{"phase": "fair", "family": "qwen-image", "system": "diffusers", "round": 0, "size": 1024, "steps": 50,
              "c1_s": 20.0, "images_per_min_one_at_a_time": 3.0, "reserved": {"shares": None, "note": "none"},
              "ours_vs_diffusers_mean_abs_pixel_diff": {"0": 0.5}}]  # fmt: skip
    results = tmp_path / "results.jsonl"
    parity = {"phase": "parity", "family": "qwen-image", "mean_abs_pixel_diff": {"1": 0.7}}
    rows.append(parity)
    results.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"phase": "ours"}\n')
    text = fair_report.report(fair_report.load([results]))
    ours = next(line for line in text.splitlines() if line.startswith("| vllm-omni-plugin"))
    assert "| 5.00 (4.00-6.00, n=3) |" in ours and "stage_0 0.9 = 126.0 GiB" in ours
    assert "| diffusers (one request at a time) | 3.00 (n=1) |" in text
    assert "`--step-execution`: False -> True (w)" in text
    assert "mean abs pixel difference 0.60 (0.50-0.70, n=2)" in text
    doc = tmp_path / "B.md"
    doc.write_text(f"# B\n{fair_report.BEGIN}\nold\n{fair_report.END}\ntail\n")
    fair_report.write_into(doc, text)
    assert "old" not in doc.read_text() and doc.read_text().endswith(f"{fair_report.END}\ntail\n")
    assert "vllm-omni-plugin" in doc.read_text()


def test_rounds_rotate_so_each_system_runs_in_each_position():
    import bench_fair

    systems = ["ours", "omni", "omni-tuned", "diffusers"]
    orders = [bench_fair.round_order(systems, r) for r in range(4)]
    assert orders[0] == systems
    assert orders[1] == ["omni", "omni-tuned", "diffusers", "ours"]
    for order in orders:
        assert sorted(order) == sorted(systems)
    for position in range(len(systems)):
        assert sorted(order[position] for order in orders) == sorted(systems)
    assert bench_fair.round_order(systems, 5) == orders[1]
    assert bench_fair.round_order(["ours", "diffusers"], 1) == ["diffusers", "ours"]
