"""`config migrate FILE`: a legacy `stage_args` file rewritten in the `stages` schema.

Interpolations (`${...}`) are kept as written; topology-owned keys are dropped (listed in a
comment), and `pipeline:` is written explicitly.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from vllm_omni_plugin.config import legacy
from vllm_omni_plugin.config.detect import find_topology
from vllm_omni_plugin.config.errors import ProblemSink
from vllm_omni_plugin.config.loading import find_config_file, read_yaml
from vllm_omni_plugin.config.scheduler import SCHEDULER_ALIASES
from vllm_omni_plugin.config.stage_keys import TOPOLOGY_OWNED


def migrated_yaml(name: str) -> str:
    path = find_config_file(name)
    sink = ProblemSink(str(name))
    data = read_yaml(path, sink)
    sink.raise_if_any()
    assert data is not None
    if not legacy.is_legacy(data):
        print(f"note: {name} already uses the stages schema; printed unchanged", file=sys.stderr)
        return yaml.safe_dump(data, sort_keys=False)
    migrated = legacy.migrate(data, sink)
    sink.raise_if_any()
    dropped: set[str] = set()
    stages = []
    for stage in migrated.get("stages", []):
        clean: dict[str, Any] = {}
        for key, value in stage.items():
            if key in TOPOLOGY_OWNED:
                dropped.add(key)
            elif key == "scheduler_cls" and isinstance(value, str):
                clean[key] = SCHEDULER_ALIASES.get(value, value)
            else:
                clean[key] = value
        stages.append(clean)
    out: dict[str, Any] = {}
    if "pipeline" not in migrated:
        topo = find_topology(None, None, migrated.get("stages", []), [path], ProblemSink(str(name)))
        if topo is not None:
            out["pipeline"] = topo.key
    for key, value in migrated.items():
        if key == "connectors" and isinstance(value, list):
            dropped.add("connectors (list form)")
            continue
        out[key] = stages if key == "stages" else value
    header = [
        f"# Migrated from {Path(name).name} (legacy stage_args) by `vllm-omni-plugin config migrate`."
    ]
    if dropped:
        header.append(
            "# Dropped, owned by the frozen pipeline topology: " + ", ".join(sorted(dropped))
        )
    return "\n".join(header) + "\n" + yaml.safe_dump(out, sort_keys=False, default_flow_style=None)
