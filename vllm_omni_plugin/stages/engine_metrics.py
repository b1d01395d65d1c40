"""An AR stage's vLLM metrics, read in the stage process for the API server's /metrics.

vLLM's AsyncLLM in the stage process records its `vllm:` Prometheus metrics (request counts,
token counts, latency histograms, KV-cache use) in that process's registry, which the API
server cannot scrape. The stage reads them as plain data (`snapshot`) and sends them in an
EngineMetrics message; serving/metrics.py exposes them beside ours, labelled by stage.
"""

from __future__ import annotations

from typing import Any

VLLM_PREFIX = "vllm:"


def snapshot(prefix: str = VLLM_PREFIX) -> list[tuple[str, str, str, list[Any]]]:
    """Every metric family of this process whose name starts with `prefix`, as plain data:
    (name, type, help, [(sample name, labels, value)])."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    out = []
    for family in get_prometheus_registry().collect():
        if not family.name.startswith(prefix):
            continue
        samples = [(s.name, dict(s.labels), float(s.value)) for s in family.samples]
        out.append((family.name, family.type, family.documentation, samples))
    return out
