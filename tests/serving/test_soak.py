"""The CI version of benchmarks/soak.py: 64 official-openai clients against
the tiny GLM-Image and Qwen-Image servers for 15 s (+ at most 10 s for requests still running),
one client in eight hanging up mid-request at times. BENCHMARKS.md has a 5-minute run.

Passes when nothing failed but the deliberate hang-ups, no stage restarted, died or stalled,
the stages hold nothing afterwards (every hang-up was dropped in every stage), and the servers'
RSS and open fds (API server and every stage process) stayed within the stated bounds
(soak.RSS_GROWTH, soak.FD_GROWTH).
"""

from __future__ import annotations

import sys

import pytest
from omni_server import API_KEY, REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import soak  # noqa: E402

pytestmark = pytest.mark.slow
DURATION_S = 15.0
GRACE_S = 10.0


def test_soak_short(shared_glm_server, small_qwen_server):
    targets = [
        soak.Target(name, s.url, s.model, s.proc.pid, API_KEY)
        for name, s in (("glm_image", shared_glm_server), ("qwen_image", small_qwen_server))
    ]
    report = soak.run_soak(
        targets, DURATION_S, clients=64, disconnect_fraction=0.125, seed=1, grace_s=GRACE_S
    )
    soak.print_report(report)
    assert report["errors"] == {}, report
    assert report["requests_done"] > 0, report
    for name, s in report["servers"].items():
        assert s["stage_changes"] == {"restarts": 0, "deaths": 0, "stalls": 0}, (name, s)
        assert s["in_flight_at_end"] == 0, (name, s)
        assert s["still_held_by_stages"] is not None, (name, s)  # the route answered
        assert not any(s["still_held_by_stages"].values()), (name, s)
        assert s["end"]["rss_bytes"] <= s["rss_bound_bytes"], (name, s)
        assert s["end"]["open_fds"] <= s["fd_bound"], (name, s)
    assert report["ok"], report
