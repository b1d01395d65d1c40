"""Which loop (loop.StageLoop subclass) a stage process runs, from its topology's StageSpec.

A topology names a stage's loop only when it is not its kind's (`StageSpec.runner`): a loop this
package ships goes by the name in `_OWN` (the pipeline module defines it), so every class here is
an import the layering test sees; a loop outside the package (a third-party pipeline's, the
tests') is "module:Class", imported in the stage process. The imports are deferred: a stage
process loads its own loop's engine only (vLLM for an AR stage, torch models for the talker).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ..pipelines.qwen3_omni import CODE2WAV_LOOP, TALKER_LOOP
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


_BY_KIND: dict[str, Callable[[], type[StageLoop]]] = {"ar": _ar, "diffusion": _diffusion}
_OWN: dict[str, Callable[[], type[StageLoop]]] = {TALKER_LOOP: _talker, CODE2WAV_LOOP: _code2wav}


def own_loop_names() -> list[str]:
    return sorted(_OWN)


def loop_class(spec: StageSpec) -> type[StageLoop]:
    """The class of `spec`'s stage loop; ValueError for a name or kind nothing here knows."""
    if spec.runner is None:
        if spec.kind not in _BY_KIND:
            raise ValueError(f"unknown stage kind {spec.kind!r}")
        return _BY_KIND[spec.kind]()
    if ":" in spec.runner:
        module, _, name = spec.runner.partition(":")
        return getattr(importlib.import_module(module), name)
    if spec.runner not in _OWN:
        raise ValueError(
            f"stage {spec.stage_id}: no stage loop named {spec.runner!r} in this package "
            f"(known: {', '.join(own_loop_names())}; a loop outside it is 'module:Class')"
        )
    return _OWN[spec.runner]()
