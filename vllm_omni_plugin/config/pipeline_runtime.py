"""The pipeline's top-level `runtime:` section: where stage replicas run (local or Ray).

    runtime: {backend: ray, address: auto}     # every stage a set of Ray actors
    stages:
      - stage_id: 0
        num_replicas: 2                          # two copies behind the orchestrator

`num_replicas` above 1 needs the Ray backend: local stage processes and headless nodes run one
copy per stage, so loading refuses it there, naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from vllm_omni_plugin.config.errors import ProblemSink, did_you_mean
from vllm_omni_plugin.config.owners_common import Owner

_RAY_ONLY = ("address", "node_ip_address", "max_restarts")


class PipelineRuntime(Owner):
    """How the orchestrator runs every stage of the pipeline (top-level `runtime:`)."""

    backend: Literal["local", "ray"] = "local"
    """"local": one process per stage on this host (or a headless node); "ray": each stage
    replica is a Ray actor, placed and restarted by Ray."""
    address: str = Field("auto", pattern=r"^(auto|local|[^\s:/]+:[0-9]{1,5})$")
    """Ray cluster to join: "auto" (RAY_ADDRESS or the cluster started on this host; none is an
    error), "local" (the server starts a private one) or "host:port" of its head; ray only."""
    node_ip_address: str | None = None
    """This host's address inside the Ray cluster (ray.init's `_node_ip_address`); None: Ray
    picks the interface that reaches the head; ray backend only."""
    max_restarts: int = Field(-1, ge=-1)
    """How often Ray restarts a replica that died (-1: without limit); ray backend only."""

    @model_validator(mode="after")
    def _ray_fields_need_ray(self) -> PipelineRuntime:
        if self.backend != "ray":
            for name in _RAY_ONLY:
                if name in self.model_fields_set:
                    raise ValueError(f"{name} applies to backend: ray only (backend is local)")
        return self


def pipeline_runtime(raw: Any, sink: ProblemSink) -> PipelineRuntime:
    """The typed `runtime:` section (defaults when absent); problems name `runtime.<field>`."""
    if raw is None:
        return PipelineRuntime()
    if not isinstance(raw, dict):
        sink.add(None, "runtime", "must be a mapping (backend, address, ...)")
        return PipelineRuntime()
    try:
        return PipelineRuntime(**raw)
    except ValidationError as exc:
        for err in exc.errors():
            key = ".".join(map(str, err["loc"]))
            if err["type"] == "extra_forbidden":
                msg = "unknown key" + did_you_mean(key, PipelineRuntime.model_fields)
            else:
                msg = err["msg"].removeprefix("Value error, ")
                key = key or next((n for n in _RAY_ONLY if msg.split()[0] == n), "backend")
            sink.add(None, f"runtime.{key}", msg)
        return PipelineRuntime()


def check_replicas(stages: list[Any], runtime: PipelineRuntime, sink: ProblemSink) -> None:
    """num_replicas above 1 acts only on the Ray backend; elsewhere it is refused at load."""
    if runtime.backend == "ray":
        return
    for stage in stages:
        if stage.num_replicas > 1:
            sink.add(
                stage.stage_id,
                "num_replicas",
                f"{stage.num_replicas} is not supported: a local stage runs as one process "
                "(stage replicas need `runtime: {backend: ray}`); set 1 or remove it",
            )
