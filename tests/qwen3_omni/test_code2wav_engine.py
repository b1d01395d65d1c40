"""The Code2Wav engine (torch only) against transformers' Code2Wav on the tiny checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni_plugin.code2wav import Code2WavDecoder, Code2WavEngine, Code2WavEngineConfig
from vllm_omni_plugin.code2wav.batching import batch_buckets, smallest_fitting, window_shapes
from vllm_omni_plugin.code2wav.chunk_decoder import ChunkDecoder
from vllm_omni_plugin.testing.qwen3_omni_reference import chat_input_ids, reference_generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: per-op overhead


@pytest.fixture(scope="module")
def decoder(omni_dir):
    return Code2WavDecoder(omni_dir)


def _codes(seed: int, frames: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, frames), generator=torch.Generator().manual_seed(seed))


def _stream(engine: Code2WavEngine, feeds: dict[str, torch.Tensor], piece: int = 7):
    """Feed each request's frames `piece` at a time, all requests interleaved; step after
    each round; return rid -> list of chunks."""
    for rid in feeds:
        engine.add_request(rid)
    chunks: dict[str, list] = {rid: [] for rid in feeds}
    longest = max(c.shape[1] for c in feeds.values())
    for i in range(0, longest, piece):
        for rid, codes in feeds.items():
            if i < codes.shape[1]:
                engine.add_frames(
                    rid, codes[:, i : i + piece], finished=i + piece >= codes.shape[1]
                )
        for c in engine.step():
            chunks[c.request_id].append(c)
    while engine.has_unfinished():
        for c in engine.step():
            chunks[c.request_id].append(c)
    return chunks


def _chunking_alone(decoder: Code2WavDecoder, codes: torch.Tensor) -> list[np.ndarray]:
    """The chunking (4 frames, then 25 with up to 25 frames of left context), each chunk's
    window decoded alone without padding: what the engine gave before it padded and batched."""
    out, decoded, emitted, total = [], 0, 0, codes.shape[1]
    while decoded < total:
        end = min(decoded + (4 if decoded == 0 else 25), total)
        w0 = max(0, decoded - 25)
        wav = decoder.decode([codes[:, w0:end]])[0].numpy()
        stop = decoder.output_length(end)
        out.append(wav[emitted - w0 * 1920 : stop - w0 * 1920])
        decoded, emitted = end, stop
    return out


def test_one_shot_equals_transformers_exactly(decoder, omni_model, omni_dir):
    """Same frames, same weights: the engine's decoder and transformers' generate's waveform
    are equal (tolerance 0: same module, same float32 ops)."""
    ref = reference_generate(omni_model, chat_input_ids(omni_dir, "Hi"), max_frames=12)
    ours = decoder.decode([ref.codes])[0].numpy()
    assert ours.shape == ref.waveform.shape
    np.testing.assert_array_equal(ours, ref.waveform)


def test_batched_windows_equal_alone(decoder):
    """Right-padded batch of different lengths == each alone within atol 1e-4 (waveform std
    ~0.2). Not bit-equal: the CPU kernels' reduction order depends on the batch shape (two
    copies of one request in a batch already differ from it alone by ~2e-5)."""
    a, b, c = _codes(1, 9), _codes(2, 40), _codes(3, 1)
    together = decoder.decode([a, b, c])
    for codes, wav in zip((a, b, c), together, strict=True):
        alone = decoder.decode([codes])[0]
        assert wav.shape == alone.shape == (codes.shape[1] * 1920 - 555,)
        torch.testing.assert_close(wav, alone, atol=1e-4, rtol=0)


def test_streamed_equals_one_shot_within_tolerance(decoder, omni_dir):
    """Chunks of 4 then 25 frames with 25 frames of left context, concatenated: same length as
    the one-shot waveform, max abs difference <= 0.01 and mean abs <= 1e-3 (waveform std ~0.2;
    the difference is the decoder looking back past the context: 72-frame attention window)."""
    codes = _codes(4, 120)
    engine = Code2WavEngine(Code2WavEngineConfig(model=str(omni_dir)), decoder)
    chunks = _stream(engine, {"r": codes})["r"]
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert len(chunks[0].samples) == 4 * 1920 - 555  # the first audio: 4 frames
    streamed = np.concatenate([c.samples for c in chunks])
    one_shot = decoder.decode([codes])[0].numpy()
    assert streamed.shape == one_shot.shape
    diff = np.abs(streamed - one_shot)
    assert diff.max() <= 0.01 and diff.mean() <= 1e-3, (diff.max(), diff.mean())
    # The first chunk sees all its context: equal up to float reduction order (atol 1e-4).
    head = 4 * 1920 - 555
    np.testing.assert_allclose(streamed[:head], one_shot[:head], atol=1e-4, rtol=0)


def test_requests_batched_together_give_what_each_gives_alone(decoder, omni_dir):
    """Three requests streamed together == each streamed alone, chunk for chunk (atol 1e-4,
    see test_batched_windows_equal_alone)."""
    feeds = {"a": _codes(5, 60), "b": _codes(6, 13), "c": _codes(7, 33)}
    cfg = Code2WavEngineConfig(model=str(omni_dir))
    together = _stream(Code2WavEngine(cfg, decoder), feeds)
    for rid, codes in feeds.items():
        alone = _stream(Code2WavEngine(cfg, decoder), {rid: codes})[rid]
        assert len(alone) == len(together[rid])
        for x, y in zip(alone, together[rid], strict=True):
            assert x.samples.shape == y.samples.shape
            np.testing.assert_allclose(x.samples, y.samples, atol=1e-4, rtol=0)


def test_bounds_and_bad_input(decoder, omni_dir):
    engine = Code2WavEngine(Code2WavEngineConfig(model=str(omni_dir), max_requests=1), decoder)
    engine.add_request("a")
    with pytest.raises(RuntimeError, match="max_requests"):
        engine.add_request("b")
    with pytest.raises(ValueError, match="codes"):
        engine.add_frames("a", torch.zeros(3, 2, dtype=torch.long))
    engine.add_frames("a", torch.full((4, 4), 64))
    with pytest.raises(ValueError, match="codebook"):
        engine.step()
    engine.abort("a")
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="left_context_frames"):
        Code2WavEngineConfig(model="x", left_context_frames=0)


def test_finished_without_new_frames_ends_with_an_empty_chunk(decoder, omni_dir):
    engine = Code2WavEngine(Code2WavEngineConfig(model=str(omni_dir)), decoder)
    engine.add_request("a")
    engine.add_frames("a", _codes(8, 4))
    first = engine.step()
    assert [c.finished for c in first] == [False]
    engine.add_frames("a", torch.zeros(4, 0, dtype=torch.long), finished=True)
    last = engine.step()
    assert [(c.finished, len(c.samples)) for c in last] == [(True, 0)]
    assert not engine.has_unfinished()


def test_frames_arriving_during_a_decode_are_not_dropped(decoder, omni_dir):
    """The talker's last frames (and its end) may arrive from another thread while a chunk is
    being decoded: that chunk is not the last, and every frame is still decoded."""
    codes = _codes(9, 40)
    engine = Code2WavEngine(Code2WavEngineConfig(model=str(omni_dir)), decoder)
    engine.add_request("a")
    engine.add_frames("a", codes[:, :4])
    decode = engine.chunks.decode

    def decode_while_the_rest_arrives(windows):
        engine.add_frames("a", codes[:, 4:], finished=True)
        return decode(windows)

    engine.chunks.decode = decode_while_the_rest_arrives  # this engine's instance only
    first = engine.step()
    del engine.chunks.decode
    assert [c.finished for c in first] == [False]
    chunks = first
    while engine.has_unfinished():
        chunks += engine.step()
    assert chunks[-1].finished
    total = sum(len(c.samples) for c in chunks)
    assert total == len(decoder.decode([codes])[0])


def test_engine_runs_without_vllm(omni_dir):
    """The Code2Wav package imports and runs with vLLM made unimportable (the talker needs
    vLLM's fused kernels: it always runs beside a vLLM thinker)."""
    import json
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import importlib.abc, json, sys

        class BlockVllm(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "vllm" or name.startswith("vllm."):
                    raise ImportError("vllm is blocked in this test")
                return None

        sys.meta_path.insert(0, BlockVllm())
        import torch
        from vllm_omni_plugin.code2wav import Code2WavEngine, Code2WavEngineConfig
        engine = Code2WavEngine(Code2WavEngineConfig(model=sys.argv[1]))
        engine.add_request("r")
        engine.add_frames("r", torch.zeros(4, 5, dtype=torch.long), finished=True)
        n = 0
        while engine.has_unfinished():
            n += sum(len(c.samples) for c in engine.step())
        loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
        print(json.dumps({"samples": n, "vllm": loaded}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(omni_dir)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "samples": 5 * 1920 - 555,
        "vllm": [],
    }


def test_window_shapes_and_batch_buckets():
    cfg = Code2WavEngineConfig(model="x")
    assert window_shapes(cfg) == (4, 50)  # first chunk; 25 new frames + 25 of context
    assert window_shapes(Code2WavEngineConfig(model="x", first_chunk_frames=50)) == (50,)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(12) == (1, 2, 4, 8, 12)
    assert batch_buckets(1) == (1,)
    assert [smallest_fitting(n, (1, 2, 4, 8, 12)) for n in (1, 2, 3, 5, 8, 9, 12)] == [
        1,
        2,
        4,
        8,
        8,
        12,
        12,
    ]
    with pytest.raises(ValueError, match="more than the largest"):
        smallest_fitting(51, (4, 50))
    with pytest.raises(ValueError, match="enforce_eager"):
        Code2WavEngineConfig(model="x", enforce_eager="yes")


def test_forwards_are_grouped_by_window_shape_and_padded_to_a_bucket(decoder):
    """Each forward: (bucket, window shape, the windows in it); more windows of one shape than
    the largest bucket take several forwards."""
    chunks = ChunkDecoder(decoder, (4, 50), max_batch_size=4, cuda_graphs=False)
    lengths = [4, 50, 3, 29, 1, 50, 5, 50, 50]
    assert chunks.plan(lengths) == [
        (4, 4, [0, 2, 4]),  # three first chunks padded to a batch of 4
        (4, 50, [1, 3, 5, 6]),
        (2, 50, [7, 8]),
    ]
    assert chunks.plan([]) == []
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        ChunkDecoder(decoder, (4, 50), max_batch_size=4, cuda_graphs=True)


def test_padded_batches_equal_each_window_decoded_alone_atol_1e_4(decoder):
    """Windows of both shapes, right-padded to their shape and to a batch bucket (rows of code
    0 added), equal each window decoded alone unpadded within atol 1e-4 in float32 (waveform
    std ~0.2; CPU reduction order depends on the batch shape)."""
    lengths = [4, 50, 3, 29, 1, 50, 5]
    windows = [_codes(20 + i, n) for i, n in enumerate(lengths)]
    chunks = ChunkDecoder(decoder, (4, 50), max_batch_size=4, cuda_graphs=False)
    together = chunks.decode(windows)
    for w, wav in zip(windows, together, strict=True):
        alone = decoder.decode([w])[0]
        assert wav.shape == alone.shape == (w.shape[1] * 1920 - 555,)
        torch.testing.assert_close(wav, alone, atol=1e-4, rtol=0)
    # Padding rows and frames are not all the same as the real ones: a window next to other
    # content than code 0 gives the same samples.
    again = chunks.decode([windows[3], _codes(99, 50)])[0]
    torch.testing.assert_close(again, together[3], atol=1e-4, rtol=0)


def test_left_padding_would_change_the_samples(decoder):
    """Why windows are right-padded: frames put in front of a window (left padding) reach its
    samples through the causal convolutions and the attention."""
    w = _codes(30, 29)
    alone = decoder.decode([w])[0]
    left = decoder.decode([torch.cat([torch.zeros(4, 21, dtype=torch.long), w], 1)])[0]
    assert (left[21 * 1920 :] - alone).abs().max() > 0.01


def test_streamed_chunks_equal_each_chunk_decoded_alone_atol_1e_4(decoder, omni_dir):
    """Eight requests of different lengths streamed together through batches of at most 4
    (padded to buckets 1, 2, 4 and to the two window shapes): each chunk equals that chunk's
    window decoded alone without padding (the engine's output before batching at static
    shapes) within atol 1e-4 in float32."""
    feeds = {f"r{i}": _codes(40 + i, n) for i, n in enumerate((3, 4, 5, 29, 30, 54, 80, 121))}
    cfg = Code2WavEngineConfig(model=str(omni_dir), max_batch_size=4)
    streamed = _stream(Code2WavEngine(cfg, decoder), feeds, piece=9)
    for rid, codes in feeds.items():
        expected = _chunking_alone(decoder, codes)
        # pieces of 9 frames: a chunk is decoded as soon as it is ready, as in the reference
        got = [c.samples for c in streamed[rid] if len(c.samples)]
        assert [len(x) for x in got] == [len(x) for x in expected], rid
        for x, y in zip(got, expected, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-4, rtol=0)
        total = sum(len(x) for x in got)
        assert total == codes.shape[1] * 1920 - 555


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_equal_eager_on_cuda(omni_dir):
    """On CUDA: the captured graphs give the eager padded batch's samples (atol 1e-5, float32;
    the same kernels at the same shapes)."""
    decoder = Code2WavDecoder(omni_dir, "cuda")
    graphed = ChunkDecoder(decoder, (4, 50), max_batch_size=8, cuda_graphs=True)
    eager = ChunkDecoder(decoder, (4, 50), max_batch_size=8, cuda_graphs=False)
    assert graphed.graphed and not eager.graphed
    windows = [_codes(50 + i, n) for i, n in enumerate((4, 50, 2, 29, 50, 50, 4, 17, 9))]
    for _ in range(2):  # replays reuse the buffers
        for x, y in zip(graphed.decode(windows), eager.decode(windows), strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


def test_audio_that_queued_up_leaves_the_stage_as_one_chunk(decoder, omni_dir):
    """The Code2Wav stage's reader takes every chunk a request has waiting, merged in order
    (samples concatenated, the last one's `finished`) and resumes the request in the engine;
    one waiting chunk leaves as it is."""
    import asyncio

    from vllm_omni_plugin.stages.qwen3_omni import Code2WavStage

    engine = Code2WavEngine(Code2WavEngineConfig(model=str(omni_dir)), decoder)
    engine.add_request("r")
    codes = _codes(9, 30)
    chunks = []
    for i in range(0, 30, 10):
        engine.add_frames("r", codes[:, i : i + 10], finished=i + 10 == 30)
        chunks += engine.step()
    while engine.has_unfinished():
        chunks += engine.step()
    assert len(chunks) >= 2 and chunks[-1].finished

    async def read(waiting):
        stage = object.__new__(Code2WavStage)
        stage.engine, stage.news, stage.outputs = engine, asyncio.Event(), {"r": asyncio.Queue()}
        engine.add_request("r")
        engine.hold("r", True)
        for chunk in waiting:
            stage.outputs["r"].put_nowait(chunk)
        first = await stage.next_output("r")
        assert stage.outputs["r"].empty() and stage.news.is_set()
        assert engine._requests["r"].held is False
        engine.abort("r")
        return first

    merged = asyncio.run(read(chunks))
    assert np.array_equal(merged.samples, np.concatenate([c.samples for c in chunks]))
    assert merged.finished and merged.request_id == "r"
    assert asyncio.run(read(chunks[:1])) is chunks[0]
