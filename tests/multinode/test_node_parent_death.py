"""A headless node ends with the process that started it.

A launcher (a stand-in for a shell, `sudo`, a supervisor script) starts `vllm serve ...
--headless` for the DiT stage of the GLM-Image NIXL split; no head runs, so the node sits
where a node whose head was killed sits: stages ready, registering again and again. The
launcher is then SIGKILLed: the node stops its stage and exits, and nothing of it (the node,
the stage in its own session) is left after NODE_BOUND_S. Before, the node went on waiting for
a head, and restarting its stage, for good.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from cluster import REPO, VLLM, node_args
from free_ports import free_port

pytestmark = pytest.mark.slow

# The node stops its stages as on SIGTERM (a DiT stage in well under a second) and exits;
# its hard deadline is 9 s (orchestrator/node.PARENT_GONE_GRACE_S).
NODE_BOUND_S = 10.0
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}
# The launcher: runs its arguments as a child and waits for it.
LAUNCHER = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_node_and_its_stage_exit_when_its_launcher_is_killed(tiny_models, tmp_path):
    model = tiny_models("glm-image")
    log = tmp_path / "node.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env.update(ENV)
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LAUNCHER,
            VLLM,
            "serve",
            *node_args(model, "127.0.0.1", free_port()),
        ],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=REPO,
        start_new_session=True,  # the launcher and the node in a group of their own
    )
    seen: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 300
        while "stage(s) [1] ready" not in log.read_text(errors="replace"):
            assert launcher.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the node's stage never became ready"
            time.sleep(0.3)
        for p in psutil.Process(launcher.pid).children(recursive=True):
            seen[p.pid] = p
        names = [" ".join(p.cmdline()) for p in seen.values()]
        assert any("omni-node" in n for n in names), names
        assert any("omni-stage-1" in n for n in names), names

        launcher.kill()
        launcher.wait()
        t0 = time.monotonic()
        while any(_alive(p) for p in seen.values()):
            left = [p.pid for p in seen.values() if _alive(p)]
            assert time.monotonic() - t0 < NODE_BOUND_S, f"alive after {NODE_BOUND_S} s: {left}"
            time.sleep(0.1)
        took = time.monotonic() - t0
        text = log.read_text(errors="replace")
        assert "is gone; stopping its stages" in text
        # Stopped as on SIGTERM, not by the node's hard deadline.
        assert "omni-stage-1: stopped in" in text and "did not stop within" not in text
        assert "Traceback" not in text, text[-3000:]
        print(f"node and stage gone {took:.1f} s after the launcher's SIGKILL")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in seen.values():
            if _alive(p):
                p.send_signal(signal.SIGKILL)
