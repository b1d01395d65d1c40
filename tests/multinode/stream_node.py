"""A headless node for the test-only streaming pipelines (tests/streaming/stream_stages.py).

    python stream_node.py HEAD_HOST HEAD_PORT STAGE_IDS

Runs the real HeadlessNode with the deploy file tests/streaming/stream_test.yaml (the same
environment variables choose the pipeline as in the head: OMNI_TEST_PIPELINE, ...), keyed by
VLLM_OMNI_AUTHKEY. `vllm serve --headless` does the same for a pipeline it can import; these
topologies live beside the tests, so this script imports them first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

STREAMING = Path(__file__).resolve().parents[1] / "streaming"
sys.path.insert(0, str(STREAMING))

import stream_stages  # noqa: E402,F401  (registers the test topologies)

from vllm_omni_plugin.config import load_deploy_config  # noqa: E402
from vllm_omni_plugin.orchestrator.node import HeadlessNode  # noqa: E402
from vllm_omni_plugin.orchestrator.node_key import explicit_key  # noqa: E402


def main(host: str, port: str, stage_ids: str) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = load_deploy_config(STREAMING / "stream_test.yaml", model="/unused")
    key = explicit_key()
    assert key is not None, "the test sets VLLM_OMNI_AUTHKEY"
    node = HeadlessNode(
        cfg,
        [int(s) for s in stage_ids.split(",")],
        (host, int(port)),
        key,
        startup_timeout_s=120,
        parent_pid=os.getppid(),
    )
    return asyncio.run(node.run())


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
