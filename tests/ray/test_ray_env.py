"""A stage under a Ray actor sees the server's plugin variables as a local stage does.

A Ray actor's process takes its node's environment (from the node's `ray start`), not the
driver's: without the actor's runtime env, a stage there would miss VLLM_OMNI_STAGE_PIPELINE,
which the API server sets for its stages (entry_points/patches.py, patch 7), and the user's
other plugin settings. Here a real one-node Ray cluster is started by `ray start` without them
(in its own network namespace, as tests/ray/ray_cluster.py keeps Ray; token authentication
with a token in a temporary home: nothing of ~/.ray is read or written); a driver that has
them creates the real StageReplicaActor (ray_backend.create_actor; no stage process started),
which reports the environment its stage process would get (stage_process.stage_env).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys

import pytest
from ray_cluster import RAY, RAY_PORT, pids_in, sh

pytestmark = pytest.mark.slow

DRIVER = """
import asyncio, json, sys
import ray
from vllm_omni_plugin.config import load_deploy_config
from vllm_omni_plugin.config.stage_init import StageInit
from vllm_omni_plugin.orchestrator.ray_backend import RayBackend
from vllm_omni_plugin.orchestrator.stage_process import stage_env

cfg = load_deploy_config(sys.argv[1])
backend = RayBackend(cfg, 60.0)
asyncio.run(backend.connect())
init = StageInit(stage=cfg.stage(0), spec=cfg.topology.stages[0], pipeline=cfg.pipeline)
actor = backend.create_actor(init, 0, edge_listener=False)
names = json.loads(sys.argv[2])


def probe(self):
    env = stage_env(self.init.stage)
    return {n: env.get(n) for n in names}


try:
    print("ENV", json.dumps(ray.get(actor.__ray_call__.remote(probe), timeout=120)))
finally:
    ray.kill(actor)
    backend.close()
"""

CONFIG = """
pipeline: qwen_image
runtime: {{backend: ray, address: "{address}"}}
stages:
  - stage_id: 0
    device: cpu
    env: {{OMNI_FROM_YAML: "yaml"}}
"""
# What the API server has and the node's `ray start` has not.
SERVER_ONLY = {
    "VLLM_OMNI_STAGE_PIPELINE": "1",  # set by `vllm serve --stage-config` (patch 7)
    "OMNI_AR_WORKER_NICE": "7",  # a user's plugin setting
    "VLLM_OMNI_AUTHKEY": "k" * 40,  # the node registry's secret: never a stage's
}


def test_a_ray_stage_gets_the_servers_plugin_variables(tmp_path):
    tag = os.getpid() % 100000
    ns, ip = f"omni-re{tag}", f"10.203.{tag % 200 + 20}.1"
    temp_dir = f"/tmp/omni-re-{tag}"  # short: Ray's unix socket paths must fit
    home = tmp_path / "home"
    home.mkdir()
    token = tmp_path / "ray_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    names = [*SERVER_ONLY, "OMNI_FROM_YAML"]
    node_env = {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "XDG_")) and k not in names
        },
        "HOME": str(home),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
    }
    config = tmp_path / "ray_env.yaml"
    config.write_text(CONFIG.format(address=f"{ip}:{RAY_PORT}"))
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "addr", "add", f"{ip}/32", "dev", "lo")
        start = ["start", "--head", "--node-ip-address", ip, "--port", str(RAY_PORT)]
        start += ["--include-dashboard=false", "--temp-dir", temp_dir, "--num-cpus", "1"]
        start += ["--object-store-memory", str(100 << 20), "--disable-usage-stats"]
        out = subprocess.run(
            ["ip", "netns", "exec", ns, RAY, *start],
            env=node_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        out = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-c", DRIVER, str(config)]
            + [json.dumps(names)],
            env={**node_env, **SERVER_ONLY},
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        for pid in pids_in(ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("ENV "))
    assert json.loads(line[4:]) == {
        "VLLM_OMNI_STAGE_PIPELINE": "1",
        "OMNI_AR_WORKER_NICE": "7",
        "VLLM_OMNI_AUTHKEY": None,
        "OMNI_FROM_YAML": "yaml",
    }
    assert not (home / ".ray").exists()
