"""Per-stage metrics for vLLM's /metrics: a collector on vLLM's own Prometheus registry.

vLLM's names (http_*, process_*, ...) stay as they are; ours carry the `omni_` prefix and a
`stage_id` label, read from the orchestrator at scrape time (no bookkeeping on the hot path).

An AR stage's own vLLM engine metrics (`vllm:*`: requests, tokens, latency histograms, KV-cache
use) live in the stage's process; it sends them every few seconds (stages/engine_metrics.py) and
they appear here under vLLM's names with `stage_id` and `stage` (the stage's name) labels added,
one family per name across stages. A restarted stage's counters start again from 0, as a
restarted vLLM server's do.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)

logger = logging.getLogger("vllm_omni_plugin.serving")

_STAGE_METRICS = (
    # (name, stats key, help, counter?)
    ("omni_stage_up", "up", "1 when the stage process is ready, 0 while it is down", False),
    ("omni_stage_restarts", "restarts", "Stage restarts after a death", True),
    ("omni_stage_deaths", "deaths", "Stage processes that died unexpectedly", True),
    (
        "omni_stage_stalls",
        "stalls",
        "Stages killed for holding requests without progress for stall_timeout_s",
        True,
    ),
    ("omni_stage_requests_completed", "completed", "Requests the stage finished", True),
    ("omni_stage_requests_failed", "failed", "Requests that failed in the stage", True),
    ("omni_stage_requests_in_flight", "in_flight", "Requests inside the stage now", False),
    ("omni_stage_busy_seconds", "busy_seconds", "Stage-side time spent on requests", True),
)


class OmniCollector:
    def __init__(
        self,
        orchestrator: Any,
        service: Any,
        pipeline: str,
        requests_metric: str = "omni_image_requests",
        requests_doc: str = "Image requests by HTTP status",
    ):
        self.orchestrator = orchestrator
        self.service = service  # its `outcomes` (status -> count); `timer`: speech latencies
        self.pipeline = pipeline
        self.requests_metric = requests_metric
        self.requests_doc = requests_doc

    def collect(self):
        stats = self.orchestrator.stage_stats()
        for name, key, doc, counter in _STAGE_METRICS:
            family_cls = CounterMetricFamily if counter else GaugeMetricFamily
            family = family_cls(name, doc, labels=["pipeline", "stage_id", "kind"])
            for s in stats:
                family.add_metric([self.pipeline, str(s["stage_id"]), s["kind"]], float(s[key]))
            yield family
        requests = CounterMetricFamily(
            self.requests_metric, self.requests_doc, labels=["pipeline", "status"]
        )
        for status, count in sorted(self.service.outcomes.items()):
            requests.add_metric([self.pipeline, status], float(count))
        yield requests
        # Images: admission (a speech service admits through vLLM's own chat handler).
        admission = getattr(self.service, "admission", None)
        if admission is not None:
            for name, value, doc in (
                ("omni_image_requests_running", admission.started, "Requests in the stages"),
                (
                    "omni_image_requests_waiting",
                    admission.waiting,
                    "Requests admitted, waiting to run (bound: serving.max_queued_requests)",
                ),
            ):
                gauge = GaugeMetricFamily(name, doc, labels=["pipeline"])
                gauge.add_metric([self.pipeline], float(value))
                yield gauge
        skipped = CounterMetricFamily(
            "omni_cache_skipped",
            "Diffusion steps whose transformer call step caching skipped, per policy",
            labels=["pipeline", "stage", "policy"],
        )
        for s in stats:
            for policy, count in sorted(s.get("cache_skipped", {}).items()):
                skipped.add_metric([self.pipeline, str(s["stage_id"]), policy], float(count))
        yield skipped
        first = SummaryMetricFamily(
            "omni_stage_time_to_first_output_seconds",
            "Streamed stages: from receiving a request to sending its first output chunk",
            labels=["pipeline", "stage_id", "kind"],
        )
        for s in stats:
            labels = [self.pipeline, str(s["stage_id"]), s["kind"]]
            first.add_metric(labels, s["first_outputs"], s["first_output_seconds"])
        yield first
        timer = getattr(self.service, "timer", None)  # speech: time to first audio, RTF
        if timer is not None:
            yield from timer.collect()
        yield from stage_engine_families(self.orchestrator.engine_metrics())
        yield from self._replica_families()

    def _replica_families(self):
        """Per replica of the stages that have several (Ray backend: orchestrator/replicas.py)."""
        rows = self.orchestrator.replica_stats()
        if not rows:
            return
        labels = ["pipeline", "stage_id", "replica", "node"]
        for name, key, doc, counter in _REPLICA_METRICS:
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(
                name, doc, labels=labels
            )
            for sid, r in rows:
                family.add_metric(
                    [self.pipeline, str(sid), str(r.replica), r.node], float(getattr(r, key))
                )
            yield family


_REPLICA_METRICS = (
    ("omni_replica_up", "up", "1 when the replica is ready, 0 while it is down", False),
    ("omni_replica_restarts", "restarts", "Replica restarts after a death", True),
    ("omni_replica_requests_completed", "completed", "Requests the replica finished", True),
    ("omni_replica_requests_in_flight", "in_flight", "Requests inside the replica now", False),
)


def stage_engine_families(per_stage: list[tuple[int, str, list]]) -> list[Metric]:
    """The stages' vLLM metric families, merged by name, each sample labelled by its stage."""
    merged: dict[str, Metric] = {}
    for stage_id, stage_name, families in per_stage:
        for name, kind, doc, samples in families:
            family = merged.get(name)
            if family is None:
                family = merged[name] = Metric(name, doc, kind)
            for sample_name, labels, value in samples:
                stage_labels = {**labels, "stage_id": str(stage_id), "stage": stage_name}
                family.add_sample(sample_name, stage_labels, value)
    return list(merged.values())


_registered: list[tuple[Any, OmniCollector]] = []


def register(collector: OmniCollector) -> None:
    """Register on vLLM's registry, replacing a collector of an earlier app in this process.

    Under PROMETHEUS_MULTIPROC_DIR vLLM's /metrics reads only the folder's per-process files
    (`get_prometheus_registry` returns a new registry on each call, none of them the route's),
    so a scrape-time collector cannot reach it: the stage families are left out, with a
    warning, and the speech histograms still arrive through the folder (speech_metrics.py).
    """
    import os

    from vllm.v1.metrics.prometheus import get_prometheus_registry

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        logger.warning(
            "PROMETHEUS_MULTIPROC_DIR is set: /metrics shows no omni_stage_* families (nor "
            "the request, cache, replica and stage-engine ones), only the speech histograms; "
            "unset it to see them"
        )
        return
    registry = get_prometheus_registry()
    while _registered:
        old_registry, old = _registered.pop()
        old_registry.unregister(old)
    registry.register(collector)
    _registered.append((registry, collector))
