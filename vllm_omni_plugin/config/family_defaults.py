"""Stage defaults a family's checkpoint would not read, refused at load naming the field.

A Qwen-Image stage (QwenImage*Pipeline) with both `guidance_scale` and `true_cfg_scale` in its
default_sampling_params: unless its transformer is guidance-distilled, guidance_scale goes
unread (common/knobs.py `ignored_guidance_default`). Read from a local model folder's
`transformer/config.json`; for a hub id the stage refuses the same defaults when it loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_omni_plugin.common.knobs import QWEN_IMAGE_PIPELINES, ignored_guidance_default
from vllm_omni_plugin.config.errors import ProblemSink


def check_family_defaults(
    pipeline_class: str | None, model_path: str | None, sampling: Any, sid: int, sink: ProblemSink
) -> None:
    if pipeline_class not in QWEN_IMAGE_PIPELINES or not model_path:
        return
    config = Path(model_path) / "transformer" / "config.json"
    if not config.is_file():
        return  # not a local folder: the stage checks when it loads the transformer
    try:
        distilled = bool(json.loads(config.read_text()).get("guidance_embeds", False))
    except (OSError, ValueError):
        return  # loading the transformer reports the unreadable file
    ignored = ignored_guidance_default(sampling.defaults_dict(), distilled)
    if ignored is not None:
        sink.add(sid, "default_sampling_params.guidance_scale", ignored)
