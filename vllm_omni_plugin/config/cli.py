"""`vllm-omni-plugin config validate | show | migrate`.

Errors print as `error: FILE: stage N: field: message`, at most 25 lines, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml

MAX_LINES = 25


def add_config_commands(subparsers: Any) -> None:
    config = subparsers.add_parser("config", help="validate, show or migrate a stage config")
    sub = config.add_subparsers(dest="config_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("file", help="deploy YAML, or a bundled name such as glm_image")
        p.add_argument("--model", default=None, help="the pipeline model (as `vllm serve MODEL`)")
        p.add_argument("--stage-overrides", default=None, help='JSON: {"<stage_id>": {...}}')
        p.add_argument(
            "--platform", default=None, help="platforms: section to apply (default: this machine's)"
        )

    validate = sub.add_parser("validate", help="check a config; exit 1 with one line per problem")
    common(validate)
    validate.set_defaults(func=_validate)

    show = sub.add_parser("show", help="print the fully resolved config")
    common(show)
    show.add_argument("--format", choices=["yaml", "json"], default="yaml")
    show.add_argument("--provenance", action="store_true", help="add which layer set each value")
    show.set_defaults(func=_show)

    migrate = sub.add_parser("migrate", help="print a legacy stage_args file in the stages schema")
    migrate.add_argument("file")
    migrate.set_defaults(func=_migrate)


def _load(args: argparse.Namespace):
    from vllm_omni_plugin.config import load_deploy_config

    return load_deploy_config(
        args.file, model=args.model, stage_overrides=args.stage_overrides, platform=args.platform
    )


def _guarded(func):
    """Config problems and any unexpected failure become short error lines, never a traceback."""

    def run(args: argparse.Namespace) -> int:
        from vllm_omni_plugin.config import ConfigError

        try:
            return func(args)
        except ConfigError as exc:
            lines = [p.format() for p in exc.problems]
        except Exception as exc:  # noqa: BLE001 - a CLI must not dump a traceback on users
            lines = [f"error: {args.file}: {type(exc).__name__}: {exc}"]
        if len(lines) > MAX_LINES:
            more = len(lines) - (MAX_LINES - 1)
            lines = lines[: MAX_LINES - 1] + [f"error: {args.file}: ... and {more} more problems"]
        for line in lines:
            print(line, file=sys.stderr)
        return 1

    return run


@_guarded
def _validate(args: argparse.Namespace) -> int:
    from vllm_omni_plugin.config.runner_settings import stage_settings

    cfg = _load(args)
    for warning in cfg.warnings[:MAX_LINES]:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"ok: {args.file}: pipeline {cfg.pipeline}, model {cfg.model or '(not set: pass MODEL)'}")
    specs = {spec.stage_id: spec for spec in cfg.topology.stages}
    for stage in cfg.stages:
        spec = specs[stage.stage_id]
        extra = ""
        if stage_settings(spec) is not None:
            extra = _runner_text(stage, spec)
        elif stage.scheduler is not None:
            extra = f", {stage.scheduler.scheduler_cls.rsplit('.', 1)[-1]} async_scheduling={stage.scheduler.async_scheduling}"
        print(
            f"  stage {stage.stage_id} {stage.name} ({stage.kind}) devices={stage.devices or '-'}"
            f" inputs={stage.inputs}{extra}"
        )
        if stage.kind == "diffusion" and spec.runner is None:
            print(f"    {_step_cache_line(stage)}")
            print(f"    {_lora_line(stage)}")
    for edge in cfg.edges:
        print(
            f"  edge {edge.from_stage} -> {edge.to_stage} via {edge.connector} ({cfg.connectors[edge.connector].type})"
        )
    # Request and job bounds, each with the layer that set it ("default" when none did).
    for section in ("serving", "videos"):
        values = getattr(cfg, section).model_dump()
        shown = " ".join(
            f"{k}={v} ({cfg.provenance.get(f'{section}.{k}', 'default')})"
            for k, v in values.items()
        )
        print(f"  {section}: {shown}")
    return 0


def _runner_text(stage, spec) -> str:
    """What a stage that reads only its own settings runs (a talker or Code2Wav engine, or a
    third-party loop), and the values of the settings it reads."""
    from vllm_omni_plugin.config.runner_settings import stage_settings

    flat = stage.flat_dict()
    read = []
    for entry in stage_settings(spec) or ():
        path = entry.partition("=")[0]
        value: Any = flat
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            read.append(f"{path}={value}")
    if spec.runner is None:
        return f", reads only: {' '.join(read) or '-'}"
    name = spec.runner.rsplit(":", 1)[-1]
    return f", runs {name} (its own loop; reads only): {' '.join(read) or '-'}"


def _lora_line(stage) -> str:
    """The stage's LoRA settings, each with the layer that set it."""
    prov = stage.provenance
    lora = stage.diffusion.lora
    if lora is None:
        return f"lora: off ({prov.get('lora', 'default')})"
    parts = [
        f"{key}={getattr(lora, key)} ({prov.get(f'lora.{key}', 'default')})"
        for key in ("dir", "max_loaded", "max_rank")
    ]
    return "lora: " + ", ".join(parts)


def _step_cache_line(stage) -> str:
    """The stage's step-cache settings, each with the layer that set it."""
    prov = stage.provenance
    sc = stage.diffusion.step_cache
    if sc is None:
        return f"step_cache: off ({prov.get('step_cache', 'default')})"
    parts = []
    for key in ("policies", "max_threshold", "default"):
        where = prov.get(f"step_cache.{key}") or next(
            (v for k, v in prov.items() if k.startswith(f"step_cache.{key}.")), "default"
        )
        parts.append(f"{key}={getattr(sc, key)} ({where})")
    return "step_cache: " + ", ".join(parts)


@_guarded
def _show(args: argparse.Namespace) -> int:
    cfg = _load(args)
    data = cfg.to_dict(provenance=args.provenance)
    if args.format == "json":
        print(json.dumps(data, indent=2, default=str))
    else:
        print(yaml.safe_dump(data, sort_keys=False, default_flow_style=False), end="")
    for warning in cfg.warnings[:MAX_LINES]:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


@_guarded
def _migrate(args: argparse.Namespace) -> int:
    from vllm_omni_plugin.config.migrate_cmd import migrated_yaml

    print(migrated_yaml(args.file), end="")
    return 0
