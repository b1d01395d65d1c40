"""Installing the plugin changes nothing for a plain `vllm serve MODEL` (no --stage-config).

One real server of a tiny stock Qwen2 model runs with our plugin installed and VLLM_PLUGINS
unset (how a user who just pip-installed us runs vLLM). Its routes and OpenAPI document must
equal those of vLLM's own app built with every plugin excluded (VLLM_PLUGINS=""); it must start
no stage processes, log nothing of ours, and serve text as stock vLLM does.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from omni_server import Server
from tiny_text_model import build_tiny_text_model

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
SERVE_ARGS = ["--enforce-eager", "--max-model-len", "256", "--dtype", "float32"]


def _dump_routes(model: Path, plugins: str, tasks: str = "generate") -> subprocess.Popen:
    """vLLM's app for the same command line, built in a fresh interpreter (no engine)."""
    import os

    env = {**os.environ, "VLLM_PLUGINS": plugins}
    return subprocess.Popen(
        [sys.executable, str(HERE / "route_dump.py"), tasks, "--", str(model), *SERVE_ARGS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain-serve")
    model = build_tiny_text_model(root / "tiny-qwen2")
    server = Server([str(model), *SERVE_ARGS], root / "server.log")  # VLLM_PLUGINS unset
    # The reference apps build while the server starts (they need no engine).
    stock = _dump_routes(model, plugins="")  # no plugin at all: stock vLLM
    listed = _dump_routes(model, plugins="omni,omni_images")  # ours named, no --stage-config
    try:
        server.wait_healthy(timeout=300)
        server.model = str(model)
        server.stock = _result(stock)
        server.listed = _result(listed)
        yield server
    finally:
        server.stop()
        for p in (stock, listed):
            if p.poll() is None:
                p.kill()


def test_same_routes_as_stock_vllm(plain):
    log = plain.log.read_text(errors="replace")
    tasks = ast.literal_eval(re.search(r"Supported tasks: (\(.*?\)|\[.*?\])", log).group(1))
    assert tuple(tasks) == ("generate",)  # what the reference apps were built for
    served = httpx.get(f"{plain.url}/openapi.json").json()
    assert sorted(served["paths"]) == sorted(plain.stock["openapi"]["paths"])
    assert served == plain.stock["openapi"]  # same routes, methods, schemas
    # Our plugins named in VLLM_PLUGINS but no --stage-config: still exactly stock.
    assert plain.listed["routes"] == plain.stock["routes"]
    assert plain.listed["openapi"] == plain.stock["openapi"]
    assert plain.listed["serve_patches"] is False  # the flag was not given: never installed
    assert "/v1/images/generations" not in served["paths"]


def test_no_stage_processes_and_nothing_of_ours_runs(plain):
    cmdlines = [" ".join(p.cmdline()) for p in plain.descendants()]
    assert cmdlines, "vLLM's EngineCore should run"
    assert not [c for c in cmdlines if "omni" in c], cmdlines
    log = plain.log.read_text(errors="replace")
    assert "(omni)" not in log and "omni-stage" not in log
    assert "vllm_omni_plugin" not in log


def test_serves_text_like_stock(plain):
    r = httpx.post(
        f"{plain.url}/v1/completions",
        json={"model": plain.model, "prompt": "hello world", "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert [m["id"] for m in httpx.get(f"{plain.url}/v1/models").json()["data"]] == [plain.model]
    r = httpx.post(f"{plain.url}/v1/images/generations", json={"prompt": "a cat"})
    assert r.status_code == 404  # vLLM's own 404: our route does not exist here
