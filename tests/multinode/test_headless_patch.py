"""Patch 5 (entry_points/patches.py): `vllm serve --headless` runs a stage node only with
--stage-config; stock vLLM's headless mode is untouched otherwise. Fresh interpreter, so that
no other test has installed the serve patches yet."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_PROBE = textwrap.dedent(
    """
    from vllm.entrypoints.cli import serve
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    original = serve.run_headless
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(["some/model", "--headless"])
    assert serve.run_headless is original, "plain --headless must stay vLLM's"

    args = parser.parse_args(["/unused/glm", "--stage-config", "glm_image_tiny_nixl",
                              "--headless", "--stage-ids", "1"])
    assert serve.run_headless.__wrapped__ is original
    assert args.headless and args.stage_ids == "1"
    try:
        serve.run_headless(args)  # our node: it needs the head's address first
    except SystemExit as exc:
        assert "--omni-master-address" in str(exc), exc
        print("PROBE-OK")
    """
)


def test_headless_runs_a_stage_node_only_with_stage_config():
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "PROBE-OK" in proc.stdout, proc.stderr[-3000:]
