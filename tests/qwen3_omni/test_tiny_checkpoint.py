"""The tiny Qwen3-Omni checkpoint: hub layout, loads in transformers, speaks."""

from __future__ import annotations

import json

import numpy as np
import torch

from vllm_omni_plugin.testing import tiny_qwen3_omni as tiny
from vllm_omni_plugin.testing.qwen3_omni_reference import chat_input_ids, reference_generate


def test_hub_layout(omni_dir):
    names = {p.name for p in omni_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
    } <= names
    config = json.loads((omni_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_omni_moe"
    assert config["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    assert config["enable_audio_output"] is True
    assert {"thinker_config", "talker_config", "code2wav_config"} <= set(config)
    assert config["talker_config"]["speaker_id"] == tiny.SPEAKERS
    for key in ("tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id"):
        assert key in config
    pre = json.loads((omni_dir / "preprocessor_config.json").read_text())
    assert pre["feature_extractor_type"] == "WhisperFeatureExtractor"
    assert pre["image_processor_type"].startswith("Qwen2VLImageProcessor")


def test_chat_template_puts_role_words_after_im_start(omni_dir):
    """The talker finds the user turns by the role token right after <|im_start|>."""
    ids = chat_input_ids(omni_dir, "Say hello.")[0].tolist()
    cfg = json.loads((omni_dir / "config.json").read_text())
    starts = [i for i, t in enumerate(ids) if t == cfg["im_start_token_id"]]
    assert [ids[i + 1] for i in starts] == [cfg["user_token_id"], cfg["assistant_token_id"]]


def test_generate_returns_audio(omni_model, omni_dir):
    ids = chat_input_ids(omni_dir, "Say hello.")
    out = reference_generate(omni_model, ids, thinker_max_new_tokens=6, max_frames=10)
    assert len(out.text_ids) == 6
    assert out.codes.shape == (tiny.NUM_CODE_GROUPS, 10)
    assert int(out.codes.max()) < tiny.CODEBOOK_SIZE
    # 1920 samples per frame, less the 555 the causal transposed convolutions hold back.
    assert out.waveform.shape == (10 * 1920 - 555,)
    assert out.waveform.dtype == np.float32
    assert 0.02 < float(out.waveform.std()) < 0.9  # audible, not clipped everywhere


def test_same_seed_same_weights(tmp_path):
    from safetensors.torch import load_file

    a = tiny.build(tmp_path / "a", seed=3)
    b = tiny.build(tmp_path / "b", seed=3)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_cli_builds_the_kind(tmp_path):
    from vllm_omni_plugin.cli import main

    assert main(["make-tiny-model", "qwen3-omni", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "config.json").exists()


def test_full_size_config_has_the_published_sizes():
    """~35B parameters at full size (counted on the meta device, nothing allocated)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from vllm_omni_plugin.testing import full_qwen3_omni as full

    tok = tiny.build_tokenizer(
        full.SPECIALS, role_ids=full.ROLE_IDS, vocab_size=full.TEXT_VOCAB_SIZE
    )
    assert len(tok) == full.TEXT_VOCAB_SIZE
    ids = tiny.token_ids(tok, full.SPECIALS)
    assert (ids["user_token_id"], ids["assistant_token_id"]) == (872, 77091)
    config = full.build_config(ids)
    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(config)
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    assert 33 < billions < 37, billions
    assert config.talker_config.accept_hidden_layer == 24
    # A shallow build (--num-layers) reads the input of the thinker's last layer.
    shallow = full.build_config(ids, num_layers=2)
    assert shallow.talker_config.accept_hidden_layer == 1


def test_layer_by_layer_writer_writes_what_save_pretrained_writes(tmp_path):
    """The full build's writer (one converted layer in memory at a time) against transformers'
    save_pretrained on the tiny model: the same config files, the same weight names (the hub's
    per-expert layout) and bit-identical tensors, in several indexed shards."""
    from safetensors.torch import load_file
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from vllm_omni_plugin.testing import full_qwen3_omni as full

    torch.manual_seed(0)
    model = Qwen3OmniMoeForConditionalGeneration(tiny.build_config()).eval()
    # Otherwise the talker's expert tensors hold whatever memory they got, NaN included, and
    # torch.equal is False for NaN against itself.
    tiny.init_talker_experts(model)
    model.generation_config = tiny.generation_config(tiny.token_ids(tiny.build_tokenizer()))
    shard_bytes = 200_000
    model.save_pretrained(tmp_path / "ref", max_shard_size=shard_bytes)
    full.save_layer_by_layer(model, tmp_path / "ours", max_shard_bytes=shard_bytes)

    def files(folder):
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1
        tensors = {}
        for name in shards:
            tensors.update(load_file(folder / name))
        assert set(index["weight_map"]) == set(tensors)
        return tensors

    ref, ours = files(tmp_path / "ref"), files(tmp_path / "ours")
    assert ref.keys() == ours.keys()
    assert any(".experts.0.gate_proj.weight" in k for k in ref)  # the hub's layout, per expert
    assert all(torch.equal(ref[k], ours[k]) for k in ref)
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "ref" / name).read_text()) == json.loads(
            (tmp_path / "ours" / name).read_text()
        )
