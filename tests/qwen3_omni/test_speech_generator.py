"""Talker + Code2Wav together (SpeechGenerator) against transformers' generate(return_audio)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni_plugin.models.qwen3_omni import SpeechGenerator
from vllm_omni_plugin.testing.qwen3_omni_reference import chat_input_ids, reference_generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: per-op overhead


def test_two_requests_streamed_equal_transformers(omni_model, omni_dir):
    """Two requests at once, the thinker's text fed one id per step: each request's codec frames
    equal transformers' exactly, its audio pieces concatenate to transformers' waveform within
    max abs 0.01 / mean abs 1e-3 (std ~0.2), and the first audio leaves before the last text."""
    prompts = {"a": "Say hello.", "b": "Hi"}  # 18 and 30 frames with this checkpoint
    refs = {}
    for rid, text in prompts.items():
        ids = chat_input_ids(omni_dir, text)
        refs[rid] = (
            ids,
            reference_generate(omni_model, ids, thinker_max_new_tokens=8, max_frames=30),
        )
    gen = SpeechGenerator(str(omni_dir))
    pending = {}
    for rid, (ids, ref) in refs.items():
        gen.add_request(rid, ids[0].tolist(), voice="ethan", max_frames=30)
        pending[rid] = list(ref.text_ids)
    audio = {rid: [] for rid in refs}
    codes = {rid: [] for rid in refs}
    first_audio_with_text_left = set()
    while gen.has_unfinished():
        for rid, text in pending.items():
            if text:
                gen.add_text(rid, text[:1], finished=len(text) == 1)
                pending[rid] = text[1:]
        for out in gen.step():
            codes[out.request_id].append(out.codes)
            if len(out.audio):
                if not audio[out.request_id] and pending[out.request_id]:
                    first_audio_with_text_left.add(out.request_id)
                audio[out.request_id].append(out.audio)
    for rid, (_, ref) in refs.items():
        assert torch.equal(torch.cat(codes[rid], dim=1), ref.codes), rid
        wav = np.concatenate(audio[rid])
        assert wav.shape == ref.waveform.shape
        diff = np.abs(wav - ref.waveform)
        assert diff.max() <= 0.01 and diff.mean() <= 1e-3, (rid, diff.max(), diff.mean())
        assert len(audio[rid]) >= 2
    assert first_audio_with_text_left == {"a", "b"}
