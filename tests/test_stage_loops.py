"""How a stage process finds its loop (stages/loops.py): the package's own loops by the name
their topology gives them, resolved by import; a loop outside the package by "module:Class"."""

from __future__ import annotations

import pytest

from vllm_omni_plugin.pipelines import available_pipelines, get_pipeline
from vllm_omni_plugin.pipelines.topology import PipelineTopology, StageSpec
from vllm_omni_plugin.stages.loop import StageLoop
from vllm_omni_plugin.stages.loops import loop_class, own_loop_names


def test_every_named_loop_of_the_packages_pipelines_resolves():
    """The package's own loops go by name, never by a "vllm_omni_plugin...:Class" string
    (which the layering test could not follow), and each name maps to a StageLoop."""
    runners = [s.runner for k in available_pipelines() for s in get_pipeline(k).stages]
    assert not [r for r in runners if r and r.startswith("vllm_omni_plugin")], runners
    named = {
        spec.runner
        for key in available_pipelines()
        for spec in get_pipeline(key).stages
        if spec.runner is not None and ":" not in spec.runner
    }
    assert named == set(own_loop_names())  # each name is used, none is missing
    for key in available_pipelines():
        for spec in get_pipeline(key).stages:
            cls = loop_class(spec)
            assert issubclass(cls, StageLoop), (key, spec.name, cls)
    talker, code2wav = get_pipeline("qwen3_omni").stages[1:]
    assert loop_class(talker).__name__ == "TalkerStage"
    assert loop_class(code2wav).__name__ == "Code2WavStage"


def test_kinds_get_their_engines_loops():
    ar = StageSpec(stage_id=0, name="ar", kind="ar")
    dit = StageSpec(stage_id=0, name="dit", kind="diffusion")
    assert loop_class(ar).__name__ == "ARStageRunner"
    assert loop_class(dit).__name__ == "DiffusionStageRunner"


def test_an_unknown_name_is_refused_with_the_known_ones():
    spec = StageSpec(stage_id=3, name="x", kind="ar", runner="qwen3_omni.singer")
    with pytest.raises(ValueError, match=r"stage 3: no stage loop named 'qwen3_omni.singer'") as e:
        loop_class(spec)
    assert "qwen3_omni.talker" in str(e.value)


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


@pytest.mark.parametrize("runner", ["mod:", ":Cls", "a:b:c"])
def test_a_malformed_module_and_class_fails_validation(runner):
    spec = StageSpec(stage_id=0, name="x", kind="diffusion", final_output=True, runner=runner)
    problems = PipelineTopology(key="t", stages=(spec,)).validate()
    assert problems == [f"stage 0: runner {runner!r} is not 'module:Class'"]
