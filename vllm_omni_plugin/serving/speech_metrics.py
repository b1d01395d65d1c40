"""Speech latency on /metrics: time to first audio and real-time factor, as histograms.

`omni_speech_time_to_first_audio_seconds`: from the request's start in the API server (after its
checks) to its first audio chunk. `omni_speech_real_time_factor`: the request's wall time over
the seconds of audio it produced (below 1: faster than real time). Counted in the API server,
where the client's experience is; the stages' own counters are the per-stage families.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from prometheus_client.core import HistogramMetricFamily

TTFA_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0, 50.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # the last: above every bound (+Inf)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def family(self, name: str, doc: str, labels: list[str], values: list[str]):
        cumulative, running = [], 0
        for bound, count in zip((*map(str, self.buckets), "+Inf"), self.counts, strict=True):
            running += count
            cumulative.append((bound, running))
        family = HistogramMetricFamily(name, doc, labels=labels)
        family.add_metric(values, cumulative, self.total)
        return family


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
    def __init__(self) -> None:
        self.ttfa = Histogram(TTFA_BUCKETS)
        self.rtf = Histogram(RTF_BUCKETS)

    def start(self, sample_rate: int) -> RequestTiming:
        return RequestTiming(self, sample_rate)

    def families(self, pipeline: str) -> list:
        return [
            self.ttfa.family(
                "omni_speech_time_to_first_audio_seconds",
                "Time from a speech request's start to its first audio chunk",
                ["pipeline"],
                [pipeline],
            ),
            self.rtf.family(
                "omni_speech_real_time_factor",
                "A speech request's wall time over the seconds of audio it produced",
                ["pipeline"],
                [pipeline],
            ),
        ]
