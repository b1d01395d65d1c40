"""Which loop (loop.StageLoop subclass) a stage process runs, from its topology's StageSpec.

Each kind this package ships has its loop here (so every class is an import the layering test
sees); a topology names a loop only when it is not its kind's (`StageSpec.runner`, a loop
outside the package: a third-party pipeline's, the tests'), as "module:Class", imported in the
stage process. The imports are deferred: a stage process loads its own loop's engine only (vLLM
for an AR or talker stage, the diffusion or Code2Wav engine for theirs).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ..pipelines.topology import StageSpec
from .loop import StageLoop


def _ar() -> type[StageLoop]:
    from .ar_stage import ARStageRunner

    return ARStageRunner


def _diffusion() -> type[StageLoop]:
    from .diffusion_stage import DiffusionStageRunner

    return DiffusionStageRunner


def _talker() -> type[StageLoop]:
    from .qwen3_omni import TalkerStage

    return TalkerStage


def _code2wav() -> type[StageLoop]:
    from .qwen3_omni import Code2WavStage

    return Code2WavStage


_BY_KIND: dict[str, Callable[[], type[StageLoop]]] = {
    "ar": _ar,
    "diffusion": _diffusion,
    "talker": _talker,
    "code2wav": _code2wav,
}


def loop_class(spec: StageSpec) -> type[StageLoop]:
    """The class of `spec`'s stage loop; ValueError for a kind or runner nothing here knows."""
    if spec.runner is None:
        if spec.kind not in _BY_KIND:
            raise ValueError(f"unknown stage kind {spec.kind!r}")
        return _BY_KIND[spec.kind]()
    module, colon, name = spec.runner.partition(":")
    if not colon:
        raise ValueError(
            f"stage {spec.stage_id}: runner {spec.runner!r} is not 'module:Class' (the loops "
            f"of this package's kinds, {', '.join(sorted(_BY_KIND))}, follow from the kind)"
        )
    return getattr(importlib.import_module(module), name)
