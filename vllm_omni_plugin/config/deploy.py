"""The resolved, typed config: what the orchestrator and each stage process receive."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm_omni_plugin.config.errors import ConfigError, ConfigProblem
from vllm_omni_plugin.config.owners_ar import ARSamplingDefaults, CacheOwner, SchedulerOwner
from vllm_omni_plugin.config.owners_code2wav import Code2WavSettings
from vllm_omni_plugin.config.owners_common import (
    ConnectorOwner,
    LoadOwner,
    ModelOwner,
    ParallelOwner,
    RuntimeOwner,
    ServingLimits,
)
from vllm_omni_plugin.config.owners_diffusion import DiffusionOwner, DiffusionSamplingDefaults
from vllm_omni_plugin.config.owners_talker import TalkerSamplingDefaults, TalkerSettings
from vllm_omni_plugin.config.owners_videos import VideoJobs
from vllm_omni_plugin.config.pipeline_runtime import PipelineRuntime
from vllm_omni_plugin.pipelines.topology import PipelineTopology, StageKind

_FROZEN = ConfigDict(frozen=True, arbitrary_types_allowed=True)

# Owner fields that are not vLLM engine arguments (ours, or vLLM-Omni wiring).
_NOT_ENGINE_ARGS = frozenset(
    {
        "model",
        "model_subdir",
        "tokenizer",
        "tokenizer_subdir",
        "devices",
        "num_replicas",
        "env",
        "async_chunk",
        "stall_timeout_s",
        "input_connectors",
        "output_connectors",
        "omni_kv_config",
        "stream_nixl_min_bytes",
        "sequence_parallel_size",
        "ulysses_degree",
        "ring_degree",
        "cfg_parallel_size",
        "vae_patch_parallel_size",
    }
)


_SAMPLING_OF_KIND: dict[str, type[BaseModel]] = {
    "ar": ARSamplingDefaults,
    "diffusion": DiffusionSamplingDefaults,
    "talker": TalkerSamplingDefaults,
}


class ConnectorSpec(BaseModel):
    """A named stage-to-stage transport."""

    model_config = _FROZEN
    name: str
    type: Literal["shm", "inproc", "nixl"]
    options: dict[str, Any] = Field(default_factory=dict)


class EdgeConfig(BaseModel):
    """One topology edge and the connector its payloads travel through."""

    model_config = _FROZEN
    from_stage: int
    to_stage: int
    connector: str


class StageConfig(BaseModel):
    """One stage, fully resolved and typed (picklable: it travels to the stage's process)."""

    model_config = _FROZEN
    stage_id: int
    name: str
    kind: StageKind
    inputs: list[int]
    emits: str
    final_output: bool
    model_path: str | None
    """Resolved model folder (or hub id) of this stage."""
    tokenizer_path: str | None
    """Resolved tokenizer of an AR stage (None: the model's own)."""
    pipeline_model_path: str | None
    """The pipeline's root model (the `vllm serve` MODEL, else the YAML's `model`)."""
    connector: ConnectorOwner
    runtime: RuntimeOwner
    model: ModelOwner | None = None
    """Which weights and tokenizer (AR and diffusion stages; the talker's and Code2Wav's come
    from the topology)."""
    load: LoadOwner | None = None
    parallel: ParallelOwner | None = None
    sampling: ARSamplingDefaults | DiffusionSamplingDefaults | TalkerSamplingDefaults | None = None
    """The stage's request defaults (None: a kind that samples nothing, Code2Wav)."""
    cache: CacheOwner | None = None
    scheduler: SchedulerOwner | None = None
    diffusion: DiffusionOwner | None = None
    talker: TalkerSettings | None = None
    """A talker stage's engine settings (all it reads besides where it runs)."""
    code2wav: Code2WavSettings | None = None
    """A Code2Wav stage's settings (all it reads besides where it runs)."""
    engine_extras: dict[str, Any] = Field(default_factory=dict)
    """Other vLLM engine arguments set for an AR stage, passed through."""
    serving: ServingLimits = Field(default_factory=ServingLimits)
    """Pipeline-wide request limits (the same object on every stage)."""
    provenance: dict[str, str] = Field(default_factory=dict)
    """Resolved field (dotted for nested values) -> the layer that set it."""

    @model_validator(mode="before")
    @classmethod
    def _sampling_of_its_kind(cls, data: Any) -> Any:
        """Read `sampling` as its kind's class: the talker's defaults are also valid AR
        defaults, so the union alone would give a stage process the wrong class."""
        if isinstance(data, dict) and isinstance(data.get("sampling"), dict):
            kind_cls = _SAMPLING_OF_KIND.get(data.get("kind"))
            if kind_cls is not None:
                data = {**data, "sampling": kind_cls.model_validate(data["sampling"])}
        return data

    @property
    def devices(self) -> str | None:
        return self.runtime.devices

    @property
    def device_ids(self) -> set[str]:
        """The GPUs `devices` names (none: CPU, or whatever a node makes visible)."""
        return set((self.devices or "").split(",")) - {""}

    @property
    def gpu_share(self) -> float | None:
        """The fraction of its GPU the stage asks for: `gpu_memory_utilization` (vLLM's budget,
        the diffusion engine's allocator cap); None where unset."""
        owner = {"ar": self.cache, "diffusion": self.diffusion, "talker": self.talker}.get(
            self.kind
        )
        return owner.gpu_memory_utilization if owner is not None else None

    @property
    def profiles_gpu_at_start(self) -> bool:
        """A vLLM engine measures the GPU's free memory while it starts, unless
        `kv_cache_memory_bytes` fixes its KV cache (then the share is only checked against the
        free memory, once)."""
        if self.kind == "talker":
            return self.talker is None or self.talker.kv_cache_memory_bytes is None
        return self.kind == "ar" and (
            self.cache is None or self.cache.kv_cache_memory_bytes is None
        )

    @property
    def num_replicas(self) -> int:
        return self.runtime.num_replicas

    @property
    def env(self) -> dict[str, str]:
        return dict(self.runtime.env)

    def owners(self) -> dict[str, BaseModel]:
        names = (
            "model",
            "load",
            "cache",
            "scheduler",
            "parallel",
            "connector",
            "runtime",
            "diffusion",
            "talker",
            "code2wav",
        )
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `vllm.AsyncEngineArgs(**kw)` / `vllm.LLM(**kw)` (AR and talker
        stages).

        Only values that are set, plus the resolved model, tokenizer and scheduler pair (an AR
        stage's; the talker's engine adds what its model needs, stages/qwen3_omni.py).
        """
        if self.kind == "talker" and self.talker is not None:
            return {**self.talker.engine_kwargs(), "model": self.model_path}
        if self.kind != "ar":
            raise TypeError(f"stage {self.stage_id} is a {self.kind} stage; it has no vLLM engine")
        kwargs: dict[str, Any] = {}
        for owner in self.owners().values():
            for key, value in owner.model_dump().items():
                if key in _NOT_ENGINE_ARGS or value is None:
                    continue
                if key not in owner.model_fields_set and key not in (
                    "scheduler_cls",
                    "async_scheduling",
                ):
                    continue
                kwargs[key] = value
        kwargs.update(self.engine_extras)
        kwargs["model"] = self.model_path
        if self.tokenizer_path:
            kwargs["tokenizer"] = self.tokenizer_path
        return kwargs

    def flat_dict(self, provenance: bool = False) -> dict[str, Any]:
        """Every resolved field, flat (the `config show` view)."""
        out: dict[str, Any] = {
            "stage_id": self.stage_id,
            "name": self.name,
            "kind": self.kind,
            "inputs": list(self.inputs),
            "emits": self.emits,
            "final_output": self.final_output,
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
        }
        for owner in self.owners().values():
            out.update(owner.model_dump())
        out.update(self.engine_extras)
        sampling = self.sampling.model_dump(exclude_none=True) if self.sampling else {}
        if not sampling.get("extra"):
            sampling.pop("extra", None)
        out["default_sampling_params"] = sampling
        out["sampling"] = sampling
        if provenance:
            out["provenance"] = dict(sorted(self.provenance.items()))
        return out


class DeployConfig(BaseModel):
    """A whole pipeline deployment: topology + one typed StageConfig per stage."""

    model_config = _FROZEN
    file: str
    model: str | None
    pipeline: str
    topology: PipelineTopology
    stages: list[StageConfig]
    edges: list[EdgeConfig]
    connectors: dict[str, ConnectorSpec]
    serving: ServingLimits
    videos: VideoJobs = Field(default_factory=VideoJobs)
    """The /v1/videos job store and video request bounds (top-level `videos:`)."""
    runtime: PipelineRuntime = Field(default_factory=PipelineRuntime)
    """Where the stage replicas run (top-level `runtime:`: local processes or Ray)."""
    platform: str | None = None
    """The `platforms:` section applied, if any."""
    async_chunk: bool = False
    warnings: list[str] = Field(default_factory=list)
    provenance: dict[str, str] = Field(default_factory=dict)
    """Pipeline-level fields -> the layer that set them."""

    def stage(self, stage_id: int) -> StageConfig:
        for stage in self.stages:
            if stage.stage_id == stage_id:
                return stage
        raise KeyError(f"pipeline {self.pipeline!r} has no stage {stage_id}")

    @property
    def final_stage(self) -> StageConfig:
        return next(s for s in self.stages if s.final_output)

    def require_model(self) -> None:
        """Raise a ConfigError when a stage has no model (neither MODEL nor YAML `model`)."""
        missing = [s.stage_id for s in self.stages if not s.model_path]
        if missing:
            raise ConfigError(
                [
                    ConfigProblem(
                        self.file,
                        None,
                        "model",
                        "no model: pass MODEL (`vllm serve MODEL --stage-config ...`) or set `model:` "
                        "in the config",
                    )
                ]
            )

    def to_dict(self, provenance: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pipeline": self.pipeline,
            "model": self.model,
            "platform": self.platform,
            "async_chunk": self.async_chunk,
            "serving": self.serving.model_dump(),
            "videos": self.videos.model_dump(),
            "runtime": self.runtime.model_dump(),
            "connectors": {k: v.model_dump() for k, v in self.connectors.items()},
            "edges": [e.model_dump() for e in self.edges],
            "stages": [s.flat_dict(provenance) for s in self.stages],
        }
        if provenance:
            out["provenance"] = dict(sorted(self.provenance.items()))
        return out
