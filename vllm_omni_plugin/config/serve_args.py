"""The deploy config named on the command line (`vllm serve [MODEL] --stage-config FILE`).

Both the API server (serving/engine_client.py) and a headless node (orchestrator/node.py) load
it, so it lives here, below both. vLLM is imported only when called, never on import.
"""

from __future__ import annotations

import argparse
from typing import Any


def requested_model(args: argparse.Namespace) -> str | None:
    """MODEL as the user gave it (positional or --model), or None if they gave none."""
    tag = getattr(args, "model_tag", None)
    if tag:
        return tag
    from vllm.engine.arg_utils import EngineArgs

    model = getattr(args, "model", None)
    return None if model in (None, EngineArgs.model) else model


def load_config(args: argparse.Namespace) -> Any:
    """The typed deploy config for `vllm serve [MODEL] --stage-config FILE`, or SystemExit."""
    from vllm_omni_plugin.config import ConfigError, load_deploy_config

    model = requested_model(args)
    try:
        cfg = load_deploy_config(
            args.stage_config, model=model, stage_overrides=args.stage_overrides
        )
    except ConfigError as exc:
        raise SystemExit(f"vllm serve --stage-config {args.stage_config}: {exc}") from None
    if not cfg.model:
        raise SystemExit(
            f"vllm serve --stage-config {args.stage_config}: no model. Pass MODEL "
            "(`vllm serve MODEL --stage-config FILE`) or set `model:` in the YAML."
        )
    return cfg
