"""Speech latency on /metrics: time to first audio and real-time factor, as histograms.

`omni_speech_time_to_first_audio_seconds`: from the request's start in the API server (after its
checks) to its first audio chunk. `omni_speech_real_time_factor`: the request's wall time over
the seconds of audio it produced (below 1: faster than real time). Counted in the API server,
where the client's experience is; the stages' own counters are the per-stage families.

The histograms are prometheus_client's, kept off every registry: the app's collector
(serving/metrics.py) yields them with the stage families, so a second app in one process (the
tests build several) starts from empty ones instead of clashing on the name. Under
PROMETHEUS_MULTIPROC_DIR, prometheus_client writes their values to that folder, where the
multiprocess registry behind vLLM's /metrics reads them.
"""

from __future__ import annotations

import time

from prometheus_client import Histogram

TTFA_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0, 50.0)


class RequestTiming:
    def __init__(self, owner: SpeechTimer, sample_rate: int):
        self.owner = owner
        self.sample_rate = sample_rate
        self.t0 = time.perf_counter()
        self.samples = 0
        self.first = False

    def audio(self, samples: int) -> None:
        if not self.first:
            self.first = True
            self.owner.ttfa.observe(time.perf_counter() - self.t0)
        self.samples += samples

    def finish(self) -> None:
        if self.samples and self.sample_rate:
            seconds = self.samples / self.sample_rate
            self.owner.rtf.observe((time.perf_counter() - self.t0) / seconds)


class SpeechTimer:
    """Both histograms of one pipeline; a prometheus_client collector (`collect`)."""

    def __init__(self, pipeline: str) -> None:
        self._families = [
            Histogram(
                "omni_speech_time_to_first_audio_seconds",
                "Time from a speech request's start to its first audio chunk",
                ["pipeline"],
                buckets=TTFA_BUCKETS,
                registry=None,
            ),
            Histogram(
                "omni_speech_real_time_factor",
                "A speech request's wall time over the seconds of audio it produced",
                ["pipeline"],
                buckets=RTF_BUCKETS,
                registry=None,
            ),
        ]
        # The labelled children exist from the start: a deployment that has not spoken yet
        # shows both families with zero counts.
        self.ttfa, self.rtf = (family.labels(pipeline) for family in self._families)

    def start(self, sample_rate: int) -> RequestTiming:
        return RequestTiming(self, sample_rate)

    def collect(self):  # noqa: ANN201 (prometheus_client's collector protocol)
        for family in self._families:
            yield from family.collect()
