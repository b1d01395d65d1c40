"""The speech histograms in Prometheus text: prometheus_client's exposition, parsed back with its
parser (bucket bounds, cumulative counts, sum, the pipeline label), and under
PROMETHEUS_MULTIPROC_DIR through the registry vLLM's /metrics builds in that mode."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_omni_plugin.serving.speech_metrics import RTF_BUCKETS, TTFA_BUCKETS, SpeechTimer

TTFA = "omni_speech_time_to_first_audio_seconds"
RTF = "omni_speech_real_time_factor"


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_an_idle_pipeline_shows_both_families_empty():
    registry = CollectorRegistry()
    registry.register(SpeechTimer("qwen3_omni"))
    text = generate_latest(registry).decode()
    got = samples(text)
    for name, bounds in ((TTFA, TTFA_BUCKETS), (RTF, RTF_BUCKETS)):
        assert f"# TYPE {name} histogram" in text
        assert got[(f"{name}_count", (("pipeline", "qwen3_omni"),))] == 0
        les = sorted(float(dict(labels)["le"]) for n, labels in got if n == f"{name}_bucket")
        assert les == [*map(float, bounds), float("inf")]


def test_a_request_lands_in_its_buckets():
    timer = SpeechTimer("p")
    registry = CollectorRegistry()
    registry.register(timer)
    timing = timer.start(sample_rate=1000)
    time.sleep(0.06)  # first audio after 60 ms: above the 0.05 bound
    timing.audio(500)
    timing.audio(500)  # one second of audio in all
    timing.finish()
    got = samples(generate_latest(registry).decode())

    def value(name, **labels):
        return got[(name, tuple(sorted({"pipeline": "p", **labels}.items())))]

    assert value(f"{TTFA}_count") == 1
    assert 0.06 <= value(f"{TTFA}_sum") < 1.0
    assert value(f"{TTFA}_bucket", le="0.05") == 0
    assert value(f"{TTFA}_bucket", le="1.0") == 1
    assert value(f"{TTFA}_bucket", le="+Inf") == 1
    # Wall time (~60 ms) over one second of audio.
    assert value(f"{RTF}_count") == 1
    assert 0.06 <= value(f"{RTF}_sum") < 1.0
    assert value(f"{RTF}_bucket", le="0.05") == 0
    assert value(f"{RTF}_bucket", le="1.0") == 1


def test_a_second_timer_starts_empty():
    """Apps built one after another in a process (tests do) each count their own requests."""
    first = SpeechTimer("p")
    first.start(1000).audio(10)
    registry = CollectorRegistry()
    registry.register(SpeechTimer("p"))
    got = samples(generate_latest(registry).decode())
    assert got[(f"{TTFA}_count", (("pipeline", "p"),))] == 0


def test_multiprocess_mode_reaches_vllms_registry(tmp_path):
    """With PROMETHEUS_MULTIPROC_DIR set, vLLM's /metrics registry reads only the folder; the
    histograms (observed in this process) are there, with their names and label. The stage
    collector, which that registry cannot carry, is not registered, and the log says so."""
    code = textwrap.dedent(
        """
        import logging
        from prometheus_client import generate_latest
        from vllm.v1.metrics.prometheus import get_prometheus_registry
        from vllm_omni_plugin.serving.metrics import OmniCollector, register
        from vllm_omni_plugin.serving.speech_metrics import SpeechTimer

        logging.basicConfig()
        register(OmniCollector(orchestrator=None, service=None, pipeline="qwen3_omni"))
        timing = SpeechTimer("qwen3_omni").start(sample_rate=1000)
        timing.audio(1000)
        timing.finish()
        print(generate_latest(get_prometheus_registry()).decode())
        """
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert "PROMETHEUS_MULTIPROC_DIR is set: /metrics shows no omni_stage_* families" in run.stderr
    got = samples(run.stdout)
    assert not [name for name, _ in got if name.startswith("omni_stage")]
    for name in (TTFA, RTF):
        assert got[(f"{name}_count", (("pipeline", "qwen3_omni"),))] == 1
        assert got[(f"{name}_bucket", (("le", "+Inf"), ("pipeline", "qwen3_omni")))] == 1
