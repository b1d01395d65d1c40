"""The talker engine (batched, vLLM's fused kernels) against transformers' talker on the tiny
checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni_plugin.code2wav import Code2WavEngine, Code2WavEngineConfig
from vllm_omni_plugin.talker import TalkerEngine, TalkerPromptError
from vllm_omni_plugin.talker.cache import SlotKVCache, TalkerCacheFull
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


def test_fused_prefill_equals_the_talker_modules_within_1e_5(omni_model, omni_dir):
    """The fused layer stack (one q/k/v and gate/up projection, the MoE router and shared
    expert's gate as one, vLLM's rope, residual-RMSNorm and SiLU kernels) against transformers'
    own talker model forward on the same embeddings, float32: hidden states within 1e-5
    (summation order), for two prompts padded together."""
    from vllm_omni_plugin.talker.runner import TalkerRunner, load_talker

    config, talker, _ = load_talker(omni_dir)
    runner = TalkerRunner(config, talker, max_batch_size=2)
    assert all(layer.gate_up is not None for layer in runner.predictor_layers)  # SiLU x up
    assert all(layer.router_weight is not None for layer in runner.talker_layers)  # fused MoE
    hidden_size = config.talker_config.text_config.hidden_size
    torch.manual_seed(0)
    prompts = [torch.randn(n, hidden_size) * 0.1 for n in (7, 12)]
    hidden, _ = runner.prefill(prompts, [runner.cache.acquire(), runner.cache.acquire()])
    reference = omni_model.talker.model
    for row, prompt in enumerate(prompts):
        positions = torch.arange(prompt.shape[0])[None].expand(3, 1, -1)
        with torch.no_grad():
            out = reference(inputs_embeds=prompt[None], position_ids=positions, use_cache=False)
        expected = out.last_hidden_state[0, -1]
        assert (hidden[row] - expected).abs().max().item() < 1e-5


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


def test_prompts_without_an_assistant_head_are_refused_on_arrival(talker, references):
    """Checked in add_request (a bad prompt failing inside a step would restart the stage)."""
    ids = references[PROMPTS[0]][0][0].tolist()
    for bad in (ids[:-3], ids[:-1]):  # no assistant turn; its head cut short
        with pytest.raises(TalkerPromptError):
            talker.add_request("bad", bad)
    assert not talker.has_unfinished()


def test_a_request_that_could_outgrow_max_model_len_is_refused_on_arrival(omni_dir, references):
    ids = references[PROMPTS[0]][0][0].tolist()
    engine = TalkerEngine(str(omni_dir), max_model_len=64)
    need = engine.conditioner.prefill_length(ids)
    engine.add_request("fits", ids, max_frames=64 - need)
    with pytest.raises(TalkerPromptError, match="max_model_len is 64"):
        engine.add_request("over", ids, max_frames=64 - need + 1)
    assert engine.runner.cache.limit == 64 and engine.runner.cache.capacity <= 64


def test_bad_requests(talker, references):
    ids = references[PROMPTS[0]][0][0].tolist()
    with pytest.raises(ValueError, match="unknown voice"):
        talker.add_request("x", ids, speaker="nobody")
    talker.add_request("y", ids, speaker="Chelsie")
    with pytest.raises(ValueError, match="already"):
        talker.add_request("y", ids)
    talker.abort("y")
    assert not talker.has_unfinished()


def test_more_requests_than_cache_slots_wait_and_a_growing_cache_keeps_them(omni_dir, references):
    """Two cache slots, three requests: the third prefills once a slot frees (after a request's
    10 frames). The cache starts 3 positions past the longest prompt, so it reallocates during
    the decode steps, while both slots hold keys. Each request's frames still equal
    transformers' for it alone."""
    engine = TalkerEngine(str(omni_dir), max_batch_size=2)
    r, c, ethan = engine.runner, engine.conditioner, engine.speakers["ethan"]
    requests = {p: (ids[0].tolist(), ref.text_ids) for p, (ids, ref) in references.items()}
    longest = max(c.prefill(ids, text[0], ethan, None).shape[0] for ids, text in requests.values())
    shape = r.cache.keys.shape
    r.cache = SlotKVCache(shape[0], 2, shape[2], shape[4], r.cache.keys.dtype, "cpu", longest + 3)
    got = _run(engine, requests, text_piece=1)
    for p, (_, ref) in references.items():
        assert torch.equal(got[p], ref.codes), p
    assert r.cache.generation >= 1 and r.cache.free_slots == 2


def test_aborted_request_frees_its_slot(omni_dir, references):
    engine = TalkerEngine(str(omni_dir), max_batch_size=1)
    (ids, ref), (ids2, ref2) = references[PROMPTS[0]], references[PROMPTS[2]]
    engine.add_request("a", ids[0].tolist(), max_frames=10)
    engine.add_text("a", ref.text_ids, finished=True)
    engine.step()
    assert engine.runner.cache.free_slots == 0
    engine.abort("a")
    codes = _run(engine, {"b": (ids2[0].tolist(), ref2.text_ids)})["b"]
    assert torch.equal(codes, ref2.codes)  # b reuses a's slot over a's stale keys
    assert engine.runner.cache.free_slots == 1


def test_slot_cache_bookkeeping():
    cache = SlotKVCache(
        2, slots=2, kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu", capacity=3
    )
    a, b = cache.acquire(), cache.acquire()
    with pytest.raises(TalkerCacheFull):
        cache.acquire()
    cache.keys[:, a, :, :3] = 1.0
    assert not cache.reserve(3) and cache.generation == 0
    assert cache.reserve(7) and cache.capacity == 12 and cache.generation == 1
    assert torch.all(cache.keys[:, a, :, :3] == 1.0) and torch.all(cache.keys[:, a, :, 3:] == 0)
    cache.release(b)
    with pytest.raises(ValueError, match="not in use"):
        cache.release(b)
    assert cache.acquire() == b
    capped = SlotKVCache(1, 1, 1, 4, torch.float32, "cpu", capacity=4, limit=10)
    assert capped.reserve(9) and capped.capacity == 10  # doubling stops at the limit
    with pytest.raises(ValueError, match="limit of 10"):
        capped.reserve(11)


def test_prefill_groups_bound_the_padded_batch():
    from vllm_omni_plugin.talker.engine import PREFILL_TOKENS, _prefill_groups, _Request

    def req(n):
        return _Request(list(range(n)), 0, 8, None)

    ready = [("a", req(100)), ("b", req(300)), ("c", req(2000)), ("d", req(PREFILL_TOKENS))]
    groups = [[rid for rid, _ in g] for g in _prefill_groups(ready)]
    # a+b+c padded to c's 2016 positions: 3 x 2016 <= 8192; d alone (over the bound by itself)
    assert groups == [["a", "b", "c"], ["d"]]


def test_outputs_that_queued_up_leave_as_one_chunk(talker):
    """The speech stages' reader takes every output a request has waiting, merged in order
    (frames concatenated, the last one's `finished`); one waiting output leaves as it is."""
    import asyncio

    from vllm_omni_plugin.code2wav import AudioChunk
    from vllm_omni_plugin.stages.qwen3_omni import Code2WavStage, TalkerStage
    from vllm_omni_plugin.talker import TalkerOutput

    async def read(stage, outs):
        stage.engine, stage.news, stage.outputs = talker, asyncio.Event(), {"r": asyncio.Queue()}
        for out in outs:
            stage.outputs["r"].put_nowait(out)
        first = await stage.next_output("r")
        assert stage.outputs["r"].empty()
        return first

    frames = [torch.full((4, 1), i) for i in range(3)]
    outs = [TalkerOutput("r", f, i == 2) for i, f in enumerate(frames)]
    merged = asyncio.run(read(object.__new__(TalkerStage), outs))
    assert torch.equal(merged.codes, torch.cat(frames, dim=1)) and merged.finished
    assert asyncio.run(read(object.__new__(TalkerStage), outs[:1])) is outs[0]
    chunks = [AudioChunk("r", np.arange(3, dtype=np.float32) + 3 * i, False) for i in range(2)]
    audio = asyncio.run(read(object.__new__(Code2WavStage), chunks))
    assert np.array_equal(audio.samples, np.arange(6, dtype=np.float32)) and not audio.finished


def test_a_gpu_only_kernel_is_used_only_if_it_runs_and_agrees(caplog):
    """layers._agrees, the load-time probe of vLLM's GPU-only kernels (fused q/k-norm-rope,
    fused MoE) against the plain path: one that raises or differs by more than 5% of the
    reference's largest magnitude is not used, and says why."""
    from vllm_omni_plugin.talker.layers import _agrees

    plain = (torch.tensor([1.0, -2.0]), torch.tensor([4.0]))

    def broken():
        raise RuntimeError("no kernel image for this device")

    assert _agrees("k", lambda: (plain[0] + 0.05, plain[1]), plain)  # bf16-sized noise
    with caplog.at_level("WARNING", logger="vllm_omni_plugin.talker"):
        assert not _agrees("k", lambda: (plain[0] * -1, plain[1]), plain)
        assert not _agrees("k", broken, plain)
    assert "differs from the plain path" in caplog.text and "no kernel image" in caplog.text
