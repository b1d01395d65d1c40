"""Typed stage configuration: the `stages` deploy schema (and legacy `stage_args`), OmegaConf
interpolation, overrides, provenance and validation. Importing this never imports torch or vLLM.

    from vllm_omni_plugin.config import load_deploy_config
    cfg = load_deploy_config("glm_image", model="/models/GLM-Image")
    cfg.stage(0).engine_kwargs()   # -> vllm.AsyncEngineArgs(**kw)
"""

from vllm_omni_plugin.config.deploy import ConnectorSpec, DeployConfig, EdgeConfig, StageConfig
from vllm_omni_plugin.config.errors import ConfigError, ConfigProblem
from vllm_omni_plugin.config.owners_ar import ARSamplingDefaults, CacheOwner, SchedulerOwner
from vllm_omni_plugin.config.owners_common import (
    ConnectorOwner,
    LoadOwner,
    ModelOwner,
    ParallelOwner,
    RuntimeOwner,
    ServingLimits,
)
from vllm_omni_plugin.config.owners_diffusion import DiffusionOwner, DiffusionSamplingDefaults
from vllm_omni_plugin.config.resolve import load_deploy_config
from vllm_omni_plugin.config.scheduler import ASYNC_SCHEDULER, SYNC_SCHEDULER

__all__ = [
    "ASYNC_SCHEDULER",
    "SYNC_SCHEDULER",
    "ARSamplingDefaults",
    "CacheOwner",
    "ConfigError",
    "ConfigProblem",
    "ConnectorOwner",
    "ConnectorSpec",
    "DeployConfig",
    "DiffusionOwner",
    "DiffusionSamplingDefaults",
    "EdgeConfig",
    "LoadOwner",
    "ModelOwner",
    "ParallelOwner",
    "RuntimeOwner",
    "SchedulerOwner",
    "ServingLimits",
    "StageConfig",
    "load_deploy_config",
]
