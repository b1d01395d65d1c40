"""`lora:` on a diffusion stage: `--stage-overrides '{"0": {"lora": {"dir": D}}}'` reaches the
engine config (with its defaults); a missing folder, bad bounds and what LoRA cannot run with are
refused at load naming the field. The request field `lora` in multipart forms: the openai
client's grouped brackets and indexed fields fold into one list."""

from __future__ import annotations

import textwrap

import pytest

from vllm_omni_plugin.cli import main
from vllm_omni_plugin.config import load_deploy_config
from vllm_omni_plugin.diffusion.config import DiffusionEngineConfig
from vllm_omni_plugin.serving.errors import APIError
from vllm_omni_plugin.serving.lora_adapters import finish_form_fields, fold_form_field

BASE = "pipeline: flux\nstages:\n  - stage_id: 0\n    device: cpu\n"


def write(tmp_path, text: str):
    path = tmp_path / "deploy.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_stage_overrides_set_the_lora_section(tmp_path):
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    cfg = load_deploy_config(
        str(write(tmp_path, BASE)),
        model=str(tmp_path),
        stage_overrides={"0": {"lora": {"dir": str(adapters)}}},
    )
    engine = DiffusionEngineConfig.from_stage_config(cfg.stages[0])
    assert engine.lora == {"dir": str(adapters), "max_loaded": 4, "max_rank": 64}


def test_validate_shows_lora_with_provenance(tmp_path, capsys):
    (tmp_path / "adapters").mkdir()
    text = BASE + f"    lora: {{dir: {tmp_path / 'adapters'}, max_rank: 32}}\n"
    assert main(["config", "validate", str(write(tmp_path, text))]) == 0
    out = capsys.readouterr().out
    assert f"lora: dir={tmp_path / 'adapters'} (yaml), max_loaded=4 (default)" in out
    assert "max_rank=32 (yaml)" in out


@pytest.mark.parametrize(
    "section, message",
    [
        ("lora: {dir: /no/such/folder}", "is not a folder"),
        ("lora: {dir: ADAPTERS, max_loaded: 0}", "max_loaded"),
        ("lora: {dir: ADAPTERS, max_rank: 0}", "max_rank"),
        ("lora: {dir: ADAPTERS, rank: 4}", "rank"),
        ("lora: {dir: ADAPTERS}\n    fuse_gelu: true", "lora cannot be combined with fuse_gelu"),
        (
            "lora: {dir: ADAPTERS}\n    step_cache: {policies: [first_block]}",
            "lora cannot be combined with step_cache",
        ),
    ],
)
def test_bad_lora_section_refused_at_load(tmp_path, capsys, section, message):
    (tmp_path / "adapters").mkdir()
    text = BASE + "    " + section.replace("ADAPTERS", str(tmp_path / "adapters")) + "\n"
    assert main(["config", "validate", str(write(tmp_path, text))]) == 1
    err = capsys.readouterr().err
    assert "lora" in err and message in err


def fold(fields: list[tuple[str, str]]) -> dict:
    data: dict = {}
    for name, value in fields:
        assert fold_form_field(data, name, value)
    finish_form_fields(data)
    return data


def test_form_fields_fold_into_one_list():
    grouped = [  # the openai client groups a repeated key's values
        ("lora[][name]", "a"),
        ("lora[][name]", "b"),
        ("lora[][scale]", "0.5"),
        ("lora[][scale]", "-1"),
    ]
    want = {"lora": [{"name": "a", "scale": 0.5}, {"name": "b", "scale": -1.0}]}
    assert fold(grouped) == want
    assert fold([grouped[0], grouped[2], grouped[1], grouped[3]]) == want  # interleaved
    indexed = fold([("lora[0][name]", "a"), ("lora[1][name]", "b"), ("lora[0][scale]", "2")])
    assert indexed == {"lora": [{"name": "a", "scale": 2.0}, {"name": "b"}]}
    assert fold([("lora", '[{"name": "a"}]')]) == {"lora": [{"name": "a"}]}
    with pytest.raises(APIError) as info:
        fold([("lora[][name]", "a"), ("lora[][scale]", "big")])
    assert info.value.param == "lora[0].scale"
    with pytest.raises(APIError):
        fold([("lora[3][name]", "a")])  # not numbered from 0


@pytest.mark.parametrize(
    "fields",
    [
        # what the openai client writes for [{"name": "a"}, {"name": "b", "scale": 0.5}]:
        # positional pairing would give a the 0.5 meant for b
        [("lora[][name]", "a"), ("lora[][name]", "b"), ("lora[][scale]", "0.5")],
        [("lora[][name]", "a"), ("lora[][scale]", "0.5"), ("lora[][scale]", "2")],
        [("lora[][name]", "a"), ("lora[1][name]", "b")],  # two ways in one form
        [("lora", '[{"name": "a"}]'), ("lora[][name]", "b")],  # JSON and fields
        [("lora[][name]", "b"), ("lora", '[{"name": "a"}]')],
    ],
)
def test_form_fields_that_cannot_be_paired_for_certain_are_refused(fields):
    with pytest.raises(APIError) as info:
        fold(fields)
    assert info.value.param == "lora" and info.value.status == 400
