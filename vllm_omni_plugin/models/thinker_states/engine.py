"""Turning the extraction on for one AR stage's vLLM engine (the stage's only hook).

`attach(kwargs)` reads the stage's opt-in from `additional_config[ADDITIONAL_CONFIG_KEY]`; when
present it starts the receiving store and rewrites the engine arguments:
- `worker_cls`: our worker (vLLM's own worker for the platform plus the extracting runner);
- prefix caching stays as configured: positions served from the prefix cache run no forward,
  so an opted-in request skips reading the cache (`opt_in`: vLLM's per-request
  `skip_reading_prefix_cache`) and every one of its prompt positions is computed, while the
  stage's other requests keep their cache hits;
- `VLLM_USE_V2_MODEL_RUNNER=0` in this process's environment (which vLLM's engine-core and worker
  processes inherit): the extraction subclasses the V1 runner, which every supported vLLM has;
- `additional_config[...]` gains the layers and the store's endpoint, which the worker reads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .settings import ADDITIONAL_CONFIG_KEY, REQUEST_KEY, WORKER_CLS, EngineSettings, StageSettings
from .store import ThinkerStatesStore

V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def requested(kwargs: dict[str, Any]) -> bool:
    return bool((kwargs.get("additional_config") or {}).get(ADDITIONAL_CONFIG_KEY) is not None)


def accept_hidden_layer(model_dir: str) -> int:
    """The talker's `accept_hidden_layer` from a local Qwen3-Omni checkpoint's config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    talker = config.get("talker_config") or {}
    if "accept_hidden_layer" not in talker:
        raise ValueError(
            f"{model_dir}: no talker_config.accept_hidden_layer; set {ADDITIONAL_CONFIG_KEY}"
            ".accept_layer in the stage config"
        )
    return int(talker["accept_hidden_layer"])


def attach(kwargs: dict[str, Any]) -> ThinkerStatesStore | None:
    """Configure `kwargs` (vLLM engine arguments, changed in place) for extraction; the store the
    engine's worker will send to, or None when the stage did not opt in."""
    if not requested(kwargs):
        return None
    additional = dict(kwargs.get("additional_config") or {})
    stage = StageSettings.from_dict(dict(additional[ADDITIONAL_CONFIG_KEY] or {}))
    layer = stage.accept_layer
    if layer is None:
        layer = accept_hidden_layer(kwargs["model"])
    if kwargs.get("worker_cls") not in (None, "auto", WORKER_CLS):
        raise ValueError(f"{ADDITIONAL_CONFIG_KEY}: the stage already sets worker_cls")
    if os.environ.get(V2_RUNNER_ENV, "0").strip().lower() in ("1", "true"):
        raise ValueError(
            f"{ADDITIONAL_CONFIG_KEY} needs vLLM's V1 model runner; unset {V2_RUNNER_ENV}"
        )
    os.environ[V2_RUNNER_ENV] = "0"
    store = ThinkerStatesStore(stage.max_request_bytes, stage.max_total_bytes, accept_layer=layer)
    additional[ADDITIONAL_CONFIG_KEY] = EngineSettings(
        layers=(0, layer), endpoint=store.endpoint, capture=stage.capture
    ).to_dict()
    kwargs["additional_config"] = additional
    kwargs["worker_cls"] = WORKER_CLS
    return store


def opt_in(params, key: str):
    """`params` (vLLM SamplingParams) marked so the worker extracts the request under `key`;
    the request reads nothing from the prefix cache, so each prompt position runs a forward."""
    params.extra_args = {**(params.extra_args or {}), REQUEST_KEY: key}
    params.skip_reading_prefix_cache = True
    return params
