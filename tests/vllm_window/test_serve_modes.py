"""With --stage-config, vLLM's multi-API-server and data-parallel supervisor paths are refused
at start-up with a clear message (entry_points/patches.py, patch 6); without it, stock.

Real argument parsing: vLLM's own `vllm` command line (`vllm.entrypoints.cli.main.main`) in a
fresh interpreter, which parses, runs `ServeSubcommand.validate` and would then pick the path.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_PROBE = textwrap.dedent(
    """
    import json, sys
    from vllm.entrypoints.cli import serve as cli_serve
    from vllm.entrypoints.cli.main import main

    # Stop where vLLM would start serving: record which path `cmd` picked instead.
    picked = []
    cli_serve.run_multi_api_server = lambda args: picked.append("multi_api_server")
    cli_serve.run_dp_supervisor = lambda args: picked.append("dp_supervisor")
    cli_serve.uvloop.run = lambda coro: (coro.close(), picked.append("single_server"))

    results = {}
    for name, argv in json.loads(sys.argv[1]).items():
        picked.clear()
        sys.argv = ["vllm", "serve", "some/model", *argv]
        try:
            main()
            results[name] = {"picked": list(picked)}
        except SystemExit as exc:
            results[name] = {"exit": str(exc.code)}
    print("RESULTS" + json.dumps(results))
    """
)

CASES = {
    "api_servers": ["--stage-config", "x.yaml", "--api-server-count", "2"],
    "dp_size": ["--stage-config", "x.yaml", "--data-parallel-size", "2"],
    "dp_multi_port": ["--stage-config", "x.yaml", "--data-parallel-multi-port-external-lb"],
    "dp_rank": ["--stage-config", "x.yaml", "--data-parallel-rank", "0"],
    "dp_hybrid": ["--stage-config", "x.yaml", "--data-parallel-hybrid-lb"],
    "one_server": ["--stage-config", "x.yaml", "--api-server-count", "1"],
    "stock_api_servers": ["--api-server-count", "2"],
}


def test_multi_server_and_data_parallel_refused_with_stage_config():
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(CASES)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS"))
    results = json.loads(line[len("RESULTS") :])
    for name, flag in (
        ("api_servers", "--api-server-count=2"),
        ("dp_size", "--data-parallel-size=2"),
        ("dp_multi_port", "--data-parallel-multi-port-external-lb=True"),
        ("dp_rank", "--data-parallel-rank=0"),
        ("dp_hybrid", "--data-parallel-hybrid-lb=True"),
    ):
        message = results[name].get("exit", "")
        assert message.startswith("vllm serve --stage-config x.yaml: " + flag), (name, results)
        assert "is not supported" in message and "deploy YAML" in message
    # Allowed: one API server with a pipeline goes to the single-server path (our patches).
    assert results["one_server"] == {"picked": ["single_server"]}
    # Without --stage-config nothing is refused: vLLM picks its multi-API-server path.
    assert results["stock_api_servers"] == {"picked": ["multi_api_server"]}
