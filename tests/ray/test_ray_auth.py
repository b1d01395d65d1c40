"""Ray's token authentication as the project uses it (orchestrator/ray_auth.py).

Real single-node Ray heads on loopback, in temporary homes (nothing of the user's ~/.ray is read
or written): the server's check refuses a head without token authentication and a head holding
another token, each with a message that says what to do, and accepts a head with its token.
`address: auto` without any cluster is refused with how to start one. Each check runs in a
fresh interpreter, as the API server would (Ray keeps its mode per process).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from free_ports import free_port
from ray_cluster import RAY

pytestmark = pytest.mark.slow

CHECK = """
import sys
from vllm_omni_plugin.orchestrator.ray_auth import RayAuthError, use_token_auth
from vllm_omni_plugin.orchestrator.ray_backend import cluster_address
try:
    use_token_auth(cluster_address(sys.argv[1]))
except RayAuthError as exc:
    print("REFUSED:", exc)
else:
    print("ACCEPTED")
"""


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "XDG_"))
    }
    return {**env, "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0", **extra}


def check(address: str, env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-c", CHECK, address], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def token_file(path: Path) -> Path:
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return path


class Head:
    def __init__(self, tmp: Path, env: dict[str, str]):
        self.env = env
        self.port = free_port()
        self.temp_dir = f"/tmp/omni-ra-{os.getpid() % 100000}-{self.port}"
        out = subprocess.run(
            [RAY, "start", "--head", "--port", str(self.port), "--num-cpus", "1"]
            + ["--include-dashboard=false", "--temp-dir", self.temp_dir]
            + ["--disable-usage-stats", "--object-store-memory", str(100 << 20)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        subprocess.run([RAY, "stop", "--force"], env=self.env, capture_output=True, timeout=120)


@pytest.fixture
def home(tmp_path):
    path = tmp_path / "home"
    path.mkdir()
    return path


def test_a_head_without_token_auth_is_refused(tmp_path, home):
    head = Head(tmp_path, clean_env(home, RAY_AUTH_MODE="disabled"))
    try:
        ours = token_file(tmp_path / "ours")
        said = check(head.address, clean_env(home, RAY_AUTH_TOKEN_PATH=str(ours)))
    finally:
        head.stop()
    assert said.startswith("REFUSED:") and "without token authentication" in said
    assert "RAY_AUTH_MODE=token ray start --head" in said
    assert not (home / ".ray" / "auth_token").exists()


def test_a_head_with_another_token_is_refused_and_its_own_token_accepted(tmp_path, home):
    theirs = token_file(tmp_path / "theirs")
    head = Head(tmp_path, clean_env(home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(theirs)))
    try:
        wrong = check(
            head.address,
            clean_env(home, RAY_AUTH_TOKEN_PATH=str(token_file(tmp_path / "other"))),
        )
        none = check(head.address, clean_env(home))
        right = check(head.address, clean_env(home, RAY_AUTH_TOKEN_PATH=str(theirs)))
        disabled = check(
            head.address,
            clean_env(home, RAY_AUTH_MODE="disabled", RAY_AUTH_TOKEN_PATH=str(theirs)),
        )
    finally:
        head.stop()
    assert wrong.startswith("REFUSED:") and "refuses this server's token" in wrong
    assert none.startswith("REFUSED:") and "none was found" in none
    assert right == "ACCEPTED"
    assert disabled.startswith("REFUSED:") and "RAY_AUTH_MODE=disabled" in disabled
    assert not (home / ".ray").exists()  # a temporary home, and nothing written to it


def test_auto_without_a_cluster_says_how_to_start_one(tmp_path, home):
    # RAY_ADDRESS naming a port nobody listens on: what `auto` finds when no cluster runs.
    ours = token_file(tmp_path / "ours")
    env = clean_env(home, RAY_ADDRESS=f"127.0.0.1:{free_port()}", RAY_AUTH_TOKEN_PATH=str(ours))
    said = check("auto", env)
    assert said.startswith("REFUSED:") and "ray start --head" in said
    assert "runtime.address: local" in said


def test_local_makes_a_private_token_outside_home(tmp_path, home):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    said = check("local", clean_env(home, XDG_RUNTIME_DIR=str(runtime)))
    assert said == "ACCEPTED"
    token = runtime / "vllm-omni" / "ray_auth_token"
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
    assert (runtime / "vllm-omni").stat().st_mode & 0o777 == 0o700
    assert not (home / ".ray").exists()
