"""The side lane on a GPU (tiny FLUX, bf16, CUDA graphs on as by default): prepare and decode
on the side lane's stream, ordered against the engine's stream by events, while the denoising
captures and replays its graphs on the engine's stream.

Tolerance 0 (every pixel equal on the 0-255 scale) against the same engine without the lane:
each request runs the same kernels on the same inputs in both (the scenario keeps every
forward's rows the same), so any difference would be a read of a tensor before the other stream
finished writing it. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from test_side_lane import Gate, decoding, pixels, run_out, staggered_run, step_until

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.cuda_graphs import StepGraphs
from vllm_omni_plugin.diffusion.phase_log import SIDE_LANE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return str(tiny_models("flux"))


def cuda_engine(model_dir, overlap) -> DiffusionEngine:
    cfg = DiffusionEngineConfig(
        model=model_dir,
        device="cuda",
        dtype="bfloat16",
        max_batch_size=8,
        overlap_encode_decode=overlap,
    )
    return DiffusionEngine(cfg)


@pytest.fixture(scope="module")
def engines(model_dir):
    on, off = cuda_engine(model_dir, True), cuda_engine(model_dir, False)
    yield on, off
    on.close()


def test_off_unless_set_on_cuda_too(model_dir):
    engine = cuda_engine(model_dir, None)
    assert engine.side_lane is None
    engine.close()
    engine = cuda_engine(model_dir, True)
    assert engine.side_lane is not None and engine.side_lane.streams.cuda
    engine.close()


def test_images_equal_without_the_lane_with_graphs_replayed(engines):
    on, off = engines
    assert isinstance(on.adapter.transformer, StepGraphs)
    for _ in range(2):  # the second round replays what the first captured
        with_lane, without = staggered_run(on), staggered_run(off)
        for rid, out in without.items():
            assert out.error is None and with_lane[rid].error is None, with_lane[rid].error
            assert (pixels(with_lane[rid].images[0]) == pixels(out.images[0])).all(), rid
    assert on.adapter.transformer.stats["replays"] > 0
    assert on.adapter.transformer.stats["failures"] == 0
    assert {s.phase for s in on.phases.spans() if s.lane == SIDE_LANE} == {"prepare", "decode"}


def test_denoising_goes_on_while_a_decode_waits_on_the_side_stream(engines):
    on, _ = engines
    outputs = {}
    gate = Gate(on, "decode", "short")
    on.add_request(GenerationRequest("short", "a cube", height=64, width=64, num_inference_steps=2))
    on.add_request(GenerationRequest("long", "a cat", height=64, width=64, num_inference_steps=6))
    step_until(on, lambda: decoding(on, "short"), outputs)
    gate.wait_entered()
    before = on.progress("long")[0]
    on.step()
    on.step()
    assert on.progress("long")[0] == before + 2
    gate.open()
    run_out(on, outputs)
    assert outputs["short"].error is None and outputs["long"].error is None
    del on.adapter.decode  # the gate off again: the class method
