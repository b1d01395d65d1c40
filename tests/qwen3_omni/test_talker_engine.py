"""The talker engine (torch only, batched) against transformers' talker on the tiny checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni_plugin.code2wav import Code2WavEngine, Code2WavEngineConfig
from vllm_omni_plugin.talker import TalkerEngine
from vllm_omni_plugin.testing.qwen3_omni_reference import chat_input_ids, reference_generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: per-op overhead

PROMPTS = ["Say hello.", "What is two plus two?", "Hi"]


@pytest.fixture(scope="module")
def talker(omni_dir):
    return TalkerEngine(str(omni_dir))


@pytest.fixture(scope="module")
def references(omni_model, omni_dir):
    return {
        p: (
            chat_input_ids(omni_dir, p),
            reference_generate(
                omni_model, chat_input_ids(omni_dir, p), thinker_max_new_tokens=6, max_frames=10
            ),
        )
        for p in PROMPTS
    }


def _run(engine: TalkerEngine, requests: dict, text_piece: int | None = None):
    """requests: rid -> (prompt ids, thinker text ids). `text_piece`: feed the text that many
    ids per step (streamed from the thinker) instead of all at once. rid -> codes [G, F]."""
    feeds = {}
    for rid, (ids, text) in requests.items():
        engine.add_request(rid, ids, speaker="ethan", max_frames=10)
        feeds[rid] = list(text)
    frames = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for rid, text in feeds.items():
            if text:
                n = len(text) if text_piece is None else text_piece
                engine.add_text(rid, text[:n], finished=len(text) <= n)
                feeds[rid] = text[n:]
        for out in engine.step():
            frames[out.request_id].append(out.codes)
    return {rid: torch.cat(f, dim=1) for rid, f in frames.items()}


def test_frames_equal_transformers(talker, references):
    """Greedy, same weights: the codec frames (all 4 code groups) equal transformers' exactly."""
    ids, ref = references[PROMPTS[0]]
    codes = _run(talker, {"r": (ids[0].tolist(), ref.text_ids)})["r"]
    assert torch.equal(codes, ref.codes)


def test_batched_with_streamed_text_equals_alone(talker, references):
    """Three requests in one batch, the thinker's text arriving one id per step: each request's
    frames equal transformers' for it alone (exact on these prompts: greedy argmax margins are
    far above the batched kernels' ~1e-6 differences)."""
    requests = {p: (ids[0].tolist(), ref.text_ids) for p, (ids, ref) in references.items()}
    got = _run(talker, requests, text_piece=1)
    for p, (_, ref) in references.items():
        assert torch.equal(got[p], ref.codes), p


def test_talker_then_code2wav_equals_transformers_waveform(talker, references, omni_dir):
    """Talker engine -> Code2Wav engine (streamed chunks 4/25, 25 context) vs transformers'
    generate(return_audio=True): max abs <= 0.01, mean abs <= 1e-3 (waveform std ~0.2)."""
    ids, ref = references[PROMPTS[1]]
    codes = _run(talker, {"r": (ids[0].tolist(), ref.text_ids)})["r"]
    c2w = Code2WavEngine(Code2WavEngineConfig(model=str(omni_dir)))
    c2w.add_request("r")
    chunks = []
    for i in range(codes.shape[1]):
        c2w.add_frames("r", codes[:, i : i + 1], finished=i == codes.shape[1] - 1)
        chunks += c2w.step()
    while c2w.has_unfinished():
        chunks += c2w.step()
    wav = np.concatenate([c.samples for c in chunks])
    assert wav.shape == ref.waveform.shape
    diff = np.abs(wav - ref.waveform)
    assert diff.max() <= 0.01 and diff.mean() <= 1e-3


def test_bad_requests(talker):
    with pytest.raises(ValueError, match="unknown voice"):
        talker.add_request("x", [1, 2], speaker="nobody")
    talker.add_request("y", [1, 2], speaker="Chelsie")
    with pytest.raises(ValueError, match="already"):
        talker.add_request("y", [1, 2])
    talker.abort("y")
    assert not talker.has_unfinished()
