"""The side lane (`overlap_encode_decode`): prepare and decode on a worker thread while the
engine thread keeps denoising the other requests, on the tiny FLUX checkpoint (real components).

Overlap is shown by the order of the engine's recorded phase spans, never by durations: a phase
on the lane is held at a gate (a wrapper around the adapter's real phase) until the test has
driven the engine thread through other requests' steps, so a lane that did not run beside the
engine thread would leave the engine blocked at the gate and the test failing.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.errors import DeviceError, DiffusionEngineError
from vllm_omni_plugin.diffusion.phase_log import ENGINE_LANE, SIDE_LANE
from vllm_omni_plugin.diffusion.runner import injected_device_error

# Generous bounds on waiting for a condition (a loaded 2-core machine): reached in
# milliseconds when things work, only a failing test runs into them.
WAIT_S = 30.0


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return str(tiny_models("flux"))


@pytest.fixture
def make_engine(model_dir):
    engines = []

    def make(overlap=True, **config):
        config.setdefault("max_batch_size", 8)
        cfg = DiffusionEngineConfig(model=model_dir, overlap_encode_decode=overlap, **config)
        engines.append(DiffusionEngine(cfg))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def req(rid, size=(64, 64), steps=4, seed=0):
    height, width = size
    return GenerationRequest(
        rid,
        f"{rid}: a red cube on a table",
        height=height,
        width=width,
        num_inference_steps=steps,
        seed=seed,
    )


class Gate:
    """Holds the adapter's real `phase` ("prepare" or "decode") of a batch that holds request
    `rid` until `open()`; `entered` is set once the phase has reached the gate."""

    def __init__(self, engine: DiffusionEngine, phase: str, rid: str) -> None:
        self.entered = threading.Event()
        self._open = threading.Event()
        real = getattr(engine.adapter, phase)

        def gated(states):
            if any(s.request_id == rid for s in states):
                self.entered.set()
                if not self._open.wait(WAIT_S):  # only when nothing ran beside the gate
                    raise TimeoutError(f"{phase} of {rid} was held and never released")
            return real(states)

        setattr(engine.adapter, phase, gated)

    def wait_entered(self) -> None:
        assert self.entered.wait(WAIT_S), "the gated phase never started"

    def open(self) -> None:
        self._open.set()


def step_until(engine, done, outputs: dict) -> None:
    """Step the engine until `done()` (collecting outputs), within WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, "condition not reached"
        for o in engine.step():
            assert o.request_id not in outputs, f"{o.request_id} emitted twice"
            outputs[o.request_id] = o


def run_out(engine, outputs: dict) -> dict:
    step_until(engine, lambda: not engine.has_unfinished(), outputs)
    return outputs


def decoding(engine, rid) -> bool:
    """Whether the request was handed to the side lane to decode."""
    return any(s.request_id == rid for s in engine.scheduler.decoding)


def steps_done(engine, rid) -> int:
    return engine.progress(rid)[0]


def spans_of(engine, phase, lane, rid):
    return [
        s
        for s in engine.phases.spans()
        if s.phase == phase and s.lane == lane and rid in s.request_ids
    ]


def inside(inner, outer) -> bool:
    return outer.start <= inner.start and inner.end <= outer.end


def pixels(image) -> np.ndarray:
    return np.asarray(image, dtype=np.int16)


# ---- the same images --------------------------------------------------------------------------
def staggered_run(engine) -> dict:
    """Five requests arriving at three moments, some while others denoise. Requests admitted
    together have one size (they share every forward, in both modes); the others each have a
    size of their own, so no request's forwards depend on when its neighbours joined."""
    outputs = {}
    engine.add_request(req("a", (64, 64), steps=6, seed=1))
    engine.add_request(req("b", (64, 64), steps=6, seed=2))
    step_until(engine, lambda: steps_done(engine, "a") >= 2, outputs)
    engine.add_request(req("c", (32, 64), steps=4, seed=3))
    engine.add_request(req("d", (64, 32), steps=5, seed=4))
    step_until(engine, lambda: steps_done(engine, "c") >= 1, outputs)
    engine.add_request(req("e", (48, 48), steps=3, seed=5))
    return run_out(engine, outputs)


def test_side_lane_images_equal_the_engine_thread_ones_bit_exact(make_engine):
    """Tolerance 0: every pixel equal with the side lane on and off (CPU)."""
    on, off = make_engine(overlap=True), make_engine(overlap=False)
    assert off.side_lane is None and on.side_lane is not None
    with_lane, without = staggered_run(on), staggered_run(off)
    assert sorted(with_lane) == sorted(without) == list("abcde")
    for rid in "abcde":
        assert with_lane[rid].error is None and without[rid].error is None
        assert (pixels(with_lane[rid].images[0]) == pixels(without[rid].images[0])).all(), rid
        assert with_lane[rid].metrics["steps"] == without[rid].metrics["steps"]
        assert with_lane[rid].metrics["prepare_s"] > 0 and with_lane[rid].metrics["decode_s"] > 0
    # Where each phase ran: prepare and decode on the lane with it, on the engine without.
    lanes = {(s.phase, s.lane) for s in on.phases.spans()}
    assert lanes == {("prepare", SIDE_LANE), ("denoise", ENGINE_LANE), ("decode", SIDE_LANE)}
    assert {s.lane for s in off.phases.spans()} == {ENGINE_LANE}
    assert not on.side_lane.busy and on.held() == {}


# ---- real overlap -----------------------------------------------------------------------------
def test_others_denoise_while_a_request_is_prepared(make_engine):
    engine = make_engine()
    outputs = {}
    engine.add_request(req("running", steps=8))
    step_until(engine, lambda: steps_done(engine, "running") >= 1, outputs)
    gate = Gate(engine, "prepare", "newcomer")
    engine.add_request(req("newcomer", (32, 32), steps=2))
    engine.step()  # admits it: its prepare goes to the lane
    gate.wait_entered()
    before = steps_done(engine, "running")
    engine.step()
    engine.step()
    # Two steps of the running request while the newcomer's prepare was held on the lane.
    assert steps_done(engine, "running") == before + 2
    assert engine.held()["newcomer"] == (0, 2)
    gate.open()
    run_out(engine, outputs)
    assert outputs["newcomer"].error is None and outputs["running"].error is None
    (prepare,) = spans_of(engine, "prepare", SIDE_LANE, "newcomer")
    beside = [s for s in spans_of(engine, "denoise", ENGINE_LANE, "running") if inside(s, prepare)]
    assert len(beside) >= 2


def test_others_denoise_while_a_request_is_decoded(make_engine):
    engine = make_engine()
    outputs = {}
    gate = Gate(engine, "decode", "short")
    engine.add_request(req("short", steps=2))
    engine.add_request(req("long", steps=6))
    # Its last step ran and its decode went to the lane; no more steps until it is at the gate.
    step_until(engine, lambda: decoding(engine, "short"), outputs)
    gate.wait_entered()
    before = steps_done(engine, "long")
    engine.step()
    engine.step()
    assert steps_done(engine, "long") == before + 2
    assert "short" not in outputs and engine.held()["short"] == (2, 2)
    gate.open()
    run_out(engine, outputs)
    assert outputs["short"].error is None and len(outputs["short"].images) == 1
    (decode,) = spans_of(engine, "decode", SIDE_LANE, "short")
    beside = [s for s in spans_of(engine, "denoise", ENGINE_LANE, "long") if inside(s, decode)]
    assert len(beside) >= 2


# ---- aborts, failures, bounds -----------------------------------------------------------------
def test_abort_while_preparing_drops_the_request(make_engine):
    engine = make_engine()
    outputs = {}
    gate = Gate(engine, "prepare", "gone")
    engine.add_request(req("gone", steps=3))
    engine.add_request(req("kept", (32, 32), steps=3))  # admitted with it: the same job
    engine.step()
    gate.wait_entered()
    state = engine.scheduler.find("gone")
    assert engine.abort("gone")
    assert "gone" not in engine.held() and engine.has_unfinished()
    assert [o.error for o in engine.step()] == ["aborted"]  # reported at once
    gate.open()
    run_out(engine, outputs)
    assert set(outputs) == {"kept"} and outputs["kept"].error is None
    assert state.latents is None and state.cond == {}  # dropped with what it held
    assert engine.scheduler.preparing == [] and not engine.side_lane.busy


def test_abort_while_decoding_drops_the_request(make_engine):
    engine = make_engine()
    outputs = {}
    gate = Gate(engine, "decode", "gone")
    engine.add_request(req("gone", steps=2))
    engine.add_request(req("kept", (32, 32), steps=4))
    step_until(engine, lambda: decoding(engine, "gone"), outputs)
    gate.wait_entered()
    state = engine.scheduler.find("gone")
    assert engine.abort("gone") and not engine.abort("gone")
    assert [o.error for o in engine.step() if o.request_id == "gone"] == ["aborted"]
    gate.open()
    run_out(engine, outputs)
    assert set(outputs) == {"kept"} and outputs["kept"].error is None
    assert state.latents is None and state.cond == {}
    assert engine.scheduler.decoding == [] and not engine.side_lane.busy
    # The engine goes on.
    assert engine.generate([req("after", steps=2)])[0].error is None


def test_a_failing_decode_fails_only_its_request(make_engine):
    engine = make_engine()
    real = engine.adapter.decode

    def decode(states):
        if any(s.request_id == "bad" for s in states):
            raise ValueError("broken VAE")
        return real(states)

    engine.adapter.decode = decode
    outs = engine.generate([req("bad", (32, 32), steps=2), req("good", steps=3)])
    assert outs[0].error == "decode failed: ValueError: broken VAE"
    assert outs[1].error is None and len(outs[1].images) == 1
    assert engine.generate([req("after", (32, 32), steps=2)])[0].error is None


def test_a_device_error_on_the_lane_raises_from_step(make_engine):
    engine = make_engine()
    real = engine.adapter.prepare

    def prepare(states):
        if any(s.request_id == "fatal" for s in states):
            raise injected_device_error()
        return real(states)

    engine.adapter.prepare = prepare
    engine.add_request(req("fatal", steps=2))
    with pytest.raises(DeviceError, match="prepare"):
        step_until(engine, lambda: False, {})


@pytest.mark.parametrize("bound", ["max_batch_size", "memory_budget"])
def test_requests_on_the_lane_count_as_admitted(make_engine, model_dir, bound):
    """Room for one request: the next one starts only once the first one's decode is back."""
    if bound == "max_batch_size":
        engine = make_engine(max_batch_size=1)
    else:
        probe = DiffusionEngine(DiffusionEngineConfig(model=model_dir, memory_budget_gb=64))
        one = probe.memory.request_bytes(64, 64)
        budget = (probe.adapter.weight_bytes() + 1.5 * one) / 2**30
        engine = make_engine(memory_budget_gb=budget)
    outputs = {}
    gate = Gate(engine, "decode", "first")
    engine.add_request(req("first", steps=2))
    engine.add_request(req("second", steps=2))
    step_until(engine, lambda: decoding(engine, "first"), outputs)
    gate.wait_entered()
    for _ in range(3):
        engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == ["second"]
    gate.open()
    run_out(engine, outputs)
    assert outputs["first"].error is None and outputs["second"].error is None
    (decode,) = spans_of(engine, "decode", SIDE_LANE, "first")
    (prepare,) = spans_of(engine, "prepare", SIDE_LANE, "second")
    assert prepare.start >= decode.end


def run_pair(engine, first, second) -> dict:
    """Two requests admitted together (one prepare, the same forwards in both modes)."""
    engine.add_request(first)
    engine.add_request(second)
    return run_out(engine, {})


@pytest.fixture(scope="module")
def lora_dir(model_dir, tmp_path_factory):
    from vllm_omni_plugin.diffusion.lora.tiny import build_tiny_lora

    root = tmp_path_factory.mktemp("loras")
    build_tiny_lora(model_dir, root / "style", rank=4, seed=1)
    return root


FEATURES = {
    # An adapter pinned at admission, applied per row in the forwards the two requests share.
    "lora": (
        lambda lora_dir: {"lora": {"dir": str(lora_dir), "max_loaded": 1, "max_rank": 8}},
        {"lora": [{"name": "style", "scale": 1.0}]},
    ),
    # Steps skipped by the step cache, decided per row.
    "step_cache": (
        lambda lora_dir: {"step_cache": {"policies": ["first_block"]}},
        {"cache": {"policy": "first_block", "threshold": 0.3}},
    ),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_features_with_the_side_lane_equal_without(make_engine, lora_dir, feature):
    """Tolerance 0: every pixel equal with the side lane on and off."""
    config, fields = FEATURES[feature]
    first = dataclasses.replace(req("with", steps=5, seed=7), **fields)
    second = req("plain", steps=4, seed=8)
    on = run_pair(make_engine(True, **config(lora_dir)), first, second)
    off = run_pair(make_engine(False, **config(lora_dir)), first, second)
    for rid in ("with", "plain"):
        assert on[rid].error is None and off[rid].error is None, (on[rid].error, off[rid].error)
        assert (pixels(on[rid].images[0]) == pixels(off[rid].images[0])).all(), rid
    if feature == "step_cache":
        assert on["with"].metrics["cache_skipped"] == off["with"].metrics["cache_skipped"]


def test_previews_beside_decodes_on_the_lane(tiny_models):
    """Qwen-Image (its VAE keeps per-call caches on the module): one request's streaming
    previews are decoded on the engine thread while others are decoded on the lane; previews
    and images equal those without the lane (tolerance 0)."""
    model = str(tiny_models("qwen-image"))

    def run(overlap):
        cfg = DiffusionEngineConfig(model=model, max_batch_size=8, overlap_encode_decode=overlap)
        engine = DiffusionEngine(cfg)
        streamed = dataclasses.replace(req("streamed", (64, 64), steps=6, seed=3), partial_images=3)
        engine.add_request(streamed)
        for i in range(3):  # each finishes in its own group: three decodes beside the previews
            engine.add_request(req(f"short{i}", (32, 32 + 16 * i), steps=2 + i, seed=i))
        outputs, previews = {}, {}
        while engine.has_unfinished():
            for o in engine.step():
                outputs[o.request_id] = o
            for rid, (index, images) in engine.take_previews().items():
                previews[(rid, index)] = images
        engine.close()
        return outputs, previews

    (out_on, prev_on), (out_off, prev_off) = run(True), run(False)
    assert sorted(out_on) == sorted(out_off) and len(out_on) == 4
    for rid, o in out_on.items():
        assert o.error is None and (pixels(o.images[0]) == pixels(out_off[rid].images[0])).all()
    assert sorted(prev_on) == sorted(prev_off) == [("streamed", i) for i in range(3)]
    for key, images in prev_on.items():
        assert (pixels(images[0]) == pixels(prev_off[key][0])).all(), key


# ---- the setting ------------------------------------------------------------------------------
def test_the_setting_from_the_deploy_file(model_dir):
    from pydantic import ValidationError

    from vllm_omni_plugin.config.owners_diffusion import DiffusionOwner

    def engine_config(**fields):
        return DiffusionEngineConfig.from_owner(DiffusionOwner(**fields), model=model_dir)

    assert engine_config(device="cpu").overlap_encode_decode is None
    assert engine_config(device="cpu", overlap_encode_decode=True).overlap_encode_decode is True
    with pytest.raises(ValidationError, match="overlap_encode_decode cannot be combined"):
        DiffusionOwner(overlap_encode_decode=True, cfg_parallel=True)
    with pytest.raises(ValidationError, match="overlap_encode_decode"):
        DiffusionOwner(overlap_encode_decode="sometimes")
    DiffusionOwner(overlap_encode_decode=False, ulysses_degree=2)  # off: nothing to refuse


def test_the_default_and_where_true_is_refused(model_dir):
    auto = DiffusionEngine(DiffusionEngineConfig(model=model_dir))
    assert auto.side_lane is None  # unset: off
    whole = DiffusionEngineConfig(
        model=model_dir, pipeline_class="SomeNewPipeline", overlap_encode_decode=True
    )
    with pytest.raises(DiffusionEngineError, match="overlap_encode_decode: .*whole pipeline"):
        DiffusionEngine(whole)
    whole.overlap_encode_decode = None  # unset: off, no error
    assert DiffusionEngine(whole).side_lane is None


def test_close_stops_the_worker(make_engine):
    engine = make_engine()
    thread = engine.side_lane._thread
    assert thread.daemon and thread.is_alive()
    engine.close()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    with pytest.raises(DiffusionEngineError, match="closed"):
        engine.generate([req("late", steps=2)])
