"""How a stage process finds its loop (stages/loops.py): each kind this package ships by its
kind, resolved by import; a loop outside the package by "module:Class"."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from vllm_omni_plugin.pipelines import available_pipelines, get_pipeline
from vllm_omni_plugin.pipelines.topology import PipelineTopology, StageSpec
from vllm_omni_plugin.stages.loop import StageLoop
from vllm_omni_plugin.stages.loops import loop_class


def package_pipelines() -> list[PipelineTopology]:
    """Every topology the package's pipeline modules define (not those other tests register)."""
    import vllm_omni_plugin.pipelines as package

    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, PipelineTopology):
                found[value.key] = value
    return list(found.values())


def test_every_stage_of_the_packages_pipelines_resolves_by_its_kind():
    """The package's own loops follow from the kind, never from a runner string (which the
    layering test could not follow)."""
    pipelines = package_pipelines()
    assert {p.key for p in pipelines} <= set(available_pipelines())
    assert "qwen3_omni" in {p.key for p in pipelines}
    for topology in pipelines:
        key = topology.key
        for spec in topology.stages:
            assert spec.runner is None, (key, spec.name, spec.runner)
            cls = loop_class(spec)
            assert issubclass(cls, StageLoop), (key, spec.name, cls)
    talker, code2wav = get_pipeline("qwen3_omni").stages[1:]
    assert (talker.kind, code2wav.kind) == ("talker", "code2wav")
    assert loop_class(talker).__name__ == "TalkerStage"
    assert loop_class(code2wav).__name__ == "Code2WavStage"


def test_kinds_get_their_engines_loops():
    ar = StageSpec(stage_id=0, name="ar", kind="ar")
    dit = StageSpec(stage_id=0, name="dit", kind="diffusion")
    assert loop_class(ar).__name__ == "ARStageRunner"
    assert loop_class(dit).__name__ == "DiffusionStageRunner"


def test_a_runner_that_is_not_module_and_class_is_refused_naming_the_kinds():
    spec = StageSpec(stage_id=3, name="x", kind="ar", runner="qwen3_omni.singer")
    with pytest.raises(ValueError, match=r"stage 3: runner 'qwen3_omni.singer' is not") as e:
        loop_class(spec)
    assert "talker" in str(e.value) and "code2wav" in str(e.value)


def test_a_loop_outside_the_package_is_imported_by_module_and_class(tmp_path, monkeypatch):
    (tmp_path / "outside_loops.py").write_text(
        "from vllm_omni_plugin.stages.loop import AsyncStageLoop\n\n"
        "class EchoStage(AsyncStageLoop):\n"
        "    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = StageSpec(stage_id=0, name="echo", kind="diffusion", runner="outside_loops:EchoStage")
    cls = loop_class(spec)
    assert cls.__module__ == "outside_loops" and issubclass(cls, StageLoop)


@pytest.mark.parametrize("runner", ["mod:", ":Cls", "a:b:c", "qwen3_omni.talker"])
def test_a_malformed_module_and_class_fails_validation(runner):
    spec = StageSpec(stage_id=0, name="x", kind="diffusion", final_output=True, runner=runner)
    problems = PipelineTopology(key="t", stages=(spec,)).validate()
    assert problems == [f"stage 0: runner {runner!r} is not 'module:Class'"]
