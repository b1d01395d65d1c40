"""A client that hangs up mid-stream leaves every stage within one step.

Observed from the stages themselves, not from the API server's bookkeeping: the guarded
`GET /v1/omni/stages?live=1` asks each stage process what its engine holds now. A diffusion
stage answers between two steps (the loop that steps answers), with the requests in its engine
(waiting or running) and their step; the AR stage answers with its running generations and
vLLM's own count of unfinished requests. Each test first sees its request inside the stage it
hangs up in (so it cannot pass vacuously), then closes the connection and polls until the
request is gone from every stage. Bound: max(1 s, 2 step times), a step time measured from the
request's own progress comments (one per denoising step; AR: tokens between two comments), the
time taken by the stages' own clocks (each answer says when the stage gave it; the HTTP reply
can lag behind on a busy machine).

Tiny GLM-Image (AR + DiT), so both stage kinds are covered: a hang-up during the AR phase (the
request must never reach the DiT) and during the DiT phase.
"""

from __future__ import annotations

import json
import time

import httpx
import psutil
import pytest
from omni_server import API_KEY

pytestmark = pytest.mark.slow
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def live(server) -> dict[int, dict]:
    """stage id -> that stage's own answer (Inspection as a dict)."""
    r = httpx.get(f"{server.url}/v1/omni/stages", params={"live": "1"}, headers=HEADERS, timeout=60)
    r.raise_for_status()
    stages = {s["stage_id"]: s["live"] for s in r.json()["stages"]}
    assert all(v is not None for v in stages.values()), stages  # every stage answered
    return stages


def holders(stages: dict[int, dict], rid: str) -> list[int]:
    return [sid for sid, s in stages.items() if rid in s["requests"]]


def stream_until(
    server, body: dict, enough, hold: psutil.Process | None = None
) -> tuple[str, list[tuple[float, dict]], dict, float]:
    """Stream `body`, collecting (time, progress) until `enough(progress list)` is true; then,
    with the connection still open, ask the stages what they hold; then hang up. Returns the
    request id, the progress seen, the stages' answer and the wall-clock time of the hang-up.

    `hold`: a process paused (SIGSTOP) from `enough` until the connection is closed, so the
    request cannot leave the phase it is in while the stages are asked (on a loaded machine an
    answer can take longer than the rest of a phase); the hang-up time is taken once it runs
    again."""
    seen: list[tuple[float, dict]] = []
    try:
        rid, inside = _stream(server, body, enough, hold, seen)
    finally:
        if hold is not None:
            hold.resume()
    return rid, seen, inside, time.time()


def _stream(server, body, enough, hold, seen) -> tuple[str, dict]:
    with httpx.stream(
        "POST",
        f"{server.url}/v1/images/generations",
        headers=HEADERS,
        json={**body, "stream": True},
        timeout=120,
    ) as r:
        assert r.status_code == 200, r.read()
        rid = r.headers["x-omni-request-id"]
        for line in r.iter_lines():
            if line.startswith(": omni.progress "):
                seen.append((time.monotonic(), json.loads(line.split(" ", 2)[2])))
                if enough(seen):
                    # Ask while still inside the loop: leaving iter_lines() closes the
                    # connection at once (httpcore closes its stream on GeneratorExit), so a
                    # look after `break` already races the abort.
                    if hold is not None:
                        hold.suspend()
                    inside = live(server)
                    break
            assert not line.startswith("event: image_generation.completed"), "finished first"
        else:
            raise AssertionError(f"the stream ended early: {seen}")
    return rid, inside


def wait_gone(server, rid: str, hung_up: float, bound: float) -> tuple[float, dict]:
    """Seconds from the hang-up (wall clock) until no stage holds `rid` and no engine counts
    it, by the stages' own clocks (each Inspection says when the stage answered; the HTTP reply
    comes later, by however busy the API server is), and the stages' last answer. Looks past
    the bound, to report how late it was."""
    while True:
        stages = live(server)
        ar_busy = stages[0]["engine_unfinished"]
        if not holders(stages, rid) and (ar_busy is None or ar_busy == 0):
            return max(s["at"] for s in stages.values()) - hung_up, stages
        if time.time() - hung_up > bound + 10:
            return float("inf"), stages


def step_time(seen: list[tuple[float, dict]], stage: str) -> float:
    """Seconds per step (diffusion) or per token (AR) between the last two comments of that
    stage (the first comment may arrive buffered with others, so never from it alone)."""
    marks = [(t, p["step"]) for t, p in seen if p["stage"] == stage]
    (t1, s1), (t2, s2) = marks[-2], marks[-1]
    return (t2 - t1) / max(1, s2 - s1)


def test_hang_up_in_the_ar_phase_leaves_every_stage(shared_glm_server):
    server = shared_glm_server
    # 1024x1024: 1281 tokens (~5 s of AR work on this CPU), so the AR phase lasts well past
    # two progress comments (one per 64 tokens, ~0.3 s apart). The AR stage's engine core is
    # paused while the stages are asked what they hold: on a loaded machine an answer once took
    # longer than the rest of the AR phase, and the request was in the DiT by then.
    body = {"prompt": "a lighthouse at dusk", "size": "1024x1024", "seed": 5}
    stage = next(p for p in server.descendants() if "omni-stage-0" in " ".join(p.cmdline()))
    core = next(p for p in stage.children(recursive=True) if "EngineCore" in p.name())
    before = live(server)
    rid, seen, inside, hung_up = stream_until(
        server, body, lambda s: sum(p["stage"] == "ar" for _, p in s) >= 2, hold=core
    )
    # Mid-stream the AR stage holds it (and vLLM counts it); the DiT never got it.
    assert holders(inside, rid) == [0], (inside, seen)
    assert inside[0]["engine_unfinished"] >= 1, inside
    bound = max(1.0, 2 * step_time(seen, "ar"))
    gone_s, after = wait_gone(server, rid, hung_up, bound)
    assert gone_s <= bound, (gone_s, bound, after)
    # It never reached the DiT stage: that stage received no Submit meanwhile.
    assert after[1]["submitted"] == before[1]["submitted"], (before, after)


def test_hang_up_in_the_dit_phase_leaves_every_stage(shared_glm_server):
    server = shared_glm_server
    # 128x128 (a short AR phase) and the most denoising steps the config allows (200): hang up
    # after the DiT's second progress comment. The stages are asked while the stream is open,
    # and the DiT keeps stepping meanwhile (its engine runs in the process that answers, so it
    # cannot be paused as the AR test pauses vLLM's engine core). On a loaded machine the
    # comment's way to this client and the question's way to the stage once took longer than
    # the rest of a 60-step phase; when the stages' answer shows the request already past the
    # DiT, the request is let go and another is asked (at most 3): what is checked, the
    # hang-up leaving every stage, is checked only on a request seen inside the DiT.
    body = {"prompt": "a lighthouse at dusk", "size": "128x128", "num_inference_steps": 200}
    for _ in range(3):
        rid, seen, inside, hung_up = stream_until(
            server, body, lambda s: sum(p["stage"] == "diffusion" for _, p in s) >= 2
        )
        if holders(inside, rid) == [1]:
            break
        wait_gone(server, rid, hung_up, 1.0)
    assert holders(inside, rid) == [1], (inside, seen)
    held = inside[1]["requests"][rid]
    assert 0 < held["step"] < held["total_steps"] == 200, held
    bound = max(1.0, 2 * step_time(seen, "diffusion"))
    gone_s, after = wait_gone(server, rid, hung_up, bound)
    assert gone_s <= bound, (gone_s, bound, after)
    assert after[1]["engine_unfinished"] == 0, after
