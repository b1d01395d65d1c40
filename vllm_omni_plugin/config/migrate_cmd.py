"""`config migrate FILE`: a vLLM-Omni file rewritten as one this plugin loads.

A legacy `stage_args` file is rewritten in the `stages` schema: interpolations (`${...}`) are
kept as written; topology-owned keys are dropped (listed in a comment), and `pipeline:` is
written explicitly. A `stages` file loses the keys that stages running their own engine do not
read (e.g. vLLM-Omni's talker settings for Qwen3-Omni), each listed in a comment with the reason
loading gives for refusing it, in the stages and in every `platforms:` section.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from vllm_omni_plugin.config import legacy
from vllm_omni_plugin.config.detect import find_topology
from vllm_omni_plugin.config.errors import ConfigError, ProblemSink
from vllm_omni_plugin.config.loading import find_config_file, read_yaml
from vllm_omni_plugin.config.scheduler import SCHEDULER_ALIASES
from vllm_omni_plugin.config.stage_keys import NESTED_SECTIONS, TOPOLOGY_OWNED


def migrated_yaml(name: str) -> str:
    path = find_config_file(name)
    sink = ProblemSink(str(name))
    data = read_yaml(path, sink)
    sink.raise_if_any()
    assert data is not None
    if not legacy.is_legacy(data):
        return _without_unread(name, path, data)
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
    print(
        f"note: dropped {len(dropped)} keys that {name}'s stages do not read here "
        "(listed, with the reason, at the top)",
        file=sys.stderr,
    )
    header = [
        f"# Migrated from {Path(name).name} (legacy stage_args) by `vllm-omni-plugin config migrate`."
    ]
    if dropped:
        header.append(
            "# Dropped, owned by the frozen pipeline topology: " + ", ".join(sorted(dropped))
        )
    return "\n".join(header) + "\n" + yaml.safe_dump(out, sort_keys=False, default_flow_style=None)


def _without_unread(name: str, path: Path, data: dict[str, Any]) -> str:
    """A stages-schema file without the keys its runner stages refuse (see the module doc)."""
    from vllm_omni_plugin.config.resolve import load_deploy_config

    platforms = data.get("platforms") if isinstance(data.get("platforms"), dict) else {}
    dropped: list[str] = []
    out = copy.deepcopy(data)
    for platform in (None, *platforms):
        try:
            # "-": no platform section applies (the stages as written)
            load_deploy_config(path, platform=platform or "-")
            continue
        except ConfigError as exc:
            unread = [p for p in exc.problems if p.unread]
        section = out if platform is None else out["platforms"][platform]
        for problem in unread:
            entry = _stage_entry(section, problem.stage_id)
            if entry is not None and _pop_path(entry, problem.field.split(".")):
                where = f"platforms.{platform}: " if platform else ""
                why = problem.message.split(". It reads only")[0].split("own engine: ")[-1]
                dropped.append(f"#   {where}stage {problem.stage_id}: {problem.field}: {why}")
        if platform is not None:
            stages = [e for e in section.get("stages") or [] if set(e) != {"stage_id"}]
            section["stages"] = stages
            if not stages and set(section) == {"stages"}:
                del out["platforms"][platform]
    if not dropped:
        print(f"note: {name} already uses the stages schema; printed unchanged", file=sys.stderr)
        return yaml.safe_dump(data, sort_keys=False)
    if "pipeline" not in out:
        topo = find_topology(None, None, [], [path], ProblemSink(str(name)))
        if topo is not None:
            out = {"pipeline": topo.key, **out}
    print(
        f"note: dropped {len(dropped)} keys that {name}'s stages do not read here "
        "(listed, with the reason, at the top)",
        file=sys.stderr,
    )
    header = [
        f"# Migrated from {Path(name).name} by `vllm-omni-plugin config migrate`.",
        "# Dropped: keys of stages that run their own engine here, which do not read them:",
    ]
    return "\n".join(header + dropped) + "\n" + yaml.safe_dump(out, sort_keys=False)


def _stage_entry(section: dict[str, Any], stage_id: int | None) -> dict[str, Any] | None:
    for entry in section.get("stages") or []:
        if isinstance(entry, dict) and entry.get("stage_id") == stage_id:
            return entry
    return None


def _pop_path(entry: dict[str, Any], parts: list[str]) -> bool:
    """Remove a (flattened) key from a stage entry, looking into its nested sections; an
    emptied mapping goes too."""
    holders = [entry] + [
        v for k, v in entry.items() if k in NESTED_SECTIONS and isinstance(v, dict)
    ]
    for holder in holders:
        node: Any = holder
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and parts[-1] in node:
            del node[parts[-1]]
            if len(parts) > 1 and node == {}:
                _pop_path(holder, parts[:-1])
            return True
    return False
