"""The stage side of the thinker's hidden states (models/thinker_states/store.py): step messages
framed as the worker frames them, over a real ZMQ PUSH socket, into the bounded store. No engine:
positions, duplicates after a recompute, the end of a request, the bounds and release."""

from __future__ import annotations

import os
import time

import pytest
import torch

# Imported at collection, before any engine test of the session: building the config's pydantic
# models parses source with `ast`, which CPython 3.11 can refuse ("AST constructor recursion
# depth mismatch") once torch's compiler has changed the recursion limit mid-session.
from vllm_omni_plugin.config import load_deploy_config
from vllm_omni_plugin.models.thinker_states import StatesOverflow, ThinkerStatesStore
from vllm_omni_plugin.models.thinker_states.settings import ChunkHeader, step_frames

DIM = 8
LAYERS = (0, 2)
ROW_BYTES = DIM * 4 * len(LAYERS)  # fp32, both layers


def rows(start: int, count: int) -> torch.Tensor:
    """Row p holds p everywhere, so every test can read back which positions it got."""
    return torch.arange(start, start + count, dtype=torch.float32)[:, None].expand(count, DIM)


class Worker:
    """A PUSH socket sending steps to the store, as vLLM's worker does."""

    def __init__(self, endpoint: str):
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.PUSH)
        self.sock.connect(endpoint)

    def step(self, *chunks: tuple[str, int, int]) -> None:
        headers = [ChunkHeader(k, s, n) for k, s, n in chunks]
        data = torch.cat([rows(s, n) for _, s, n in chunks])
        self.sock.send_multipart(step_frames(LAYERS, headers, [data, -data]))

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def store():
    s = ThinkerStatesStore(max_request_bytes=10 * ROW_BYTES, max_total_bytes=16 * ROW_BYTES)
    yield s
    s.close()


@pytest.fixture
def worker(store):
    w = Worker(store.endpoint)
    yield w
    w.close()


def wait_held(store, key, nbytes, timeout=5.0):
    deadline = time.monotonic() + timeout
    while store.held(key) != nbytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.held(key) == nbytes


def positions(chunks) -> list[int]:
    return [int(v) for c in chunks for v in c.layers[0][:, 0]]


def test_positions_in_order_across_steps_and_requests(store, worker):
    store.open("a")
    store.open("b")
    worker.step(("a", 0, 3), ("b", 0, 2))  # one step, two requests
    worker.step(("a", 3, 1), ("b", 2, 1))
    store.finish("a", 4)
    store.finish("b", 3)
    a = store.collect("a")
    assert a.start == 0 and a.layers[0][:, 0].tolist() == [0, 1, 2, 3]
    assert torch.equal(a.layers[2], -a.layers[0])
    assert store.collect("b").layers[0][:, 0].tolist() == [0, 1, 2]
    assert store.take("a") is None  # the stream is over
    store.release("a")
    store.release("b")
    assert store.held_bytes == 0


def test_recomputed_positions_are_kept_once(store, worker):
    """A request preempted and recomputed sends its positions again: kept once."""
    store.open("a")
    worker.step(("a", 0, 4))
    worker.step(("a", 0, 6))  # recompute from scratch, two positions further
    store.finish("a", 6)
    assert positions([store.collect("a")]) == list(range(6))
    assert store.repeated_positions == 4


def test_positions_past_the_end_are_dropped(store, worker):
    """A stop string the engine noticed a step late: the extra position is no part of it."""
    store.open("a")
    worker.step(("a", 0, 5))
    wait_held(store, "a", 5 * ROW_BYTES)
    store.finish("a", 3)
    assert store.held("a") == 3 * ROW_BYTES
    worker.step(("a", 5, 1))
    assert positions([store.collect("a")]) == [0, 1, 2]


def test_consumed_states_are_released(store, worker):
    store.open("a")
    worker.step(("a", 0, 4))
    wait_held(store, "a", 4 * ROW_BYTES)
    assert positions(store.take("a")) == [0, 1, 2, 3]
    assert store.held("a") == 0 and store.held_bytes == 0
    assert store.take("a", timeout=0.05) == []  # nothing new yet, not over


def test_unknown_and_released_keys_hold_nothing(store, worker):
    store.open("a")
    worker.step(("a", 0, 2), ("never-opened", 0, 3))
    wait_held(store, "a", 2 * ROW_BYTES)
    store.release("a")  # an abort
    worker.step(("a", 2, 1))  # a step already in flight
    time.sleep(0.2)
    assert store.held_bytes == 0 and store.keys() == []


def test_request_bound_fails_that_request_only(store, worker):
    store.open("big")
    store.open("small")
    worker.step(("big", 0, 8), ("small", 0, 1))
    worker.step(("big", 8, 3), ("small", 1, 1))  # big: 11 rows > 10
    store.finish("small", 2)
    assert positions([store.collect("small")]) == [0, 1]
    with pytest.raises(StatesOverflow, match="bytes held"):
        store.take("big", timeout=5)
    assert store.held("big") == 0
    worker.step(("big", 11, 1))  # nothing more is kept for it
    time.sleep(0.2)
    assert store.held("big") == 0


def test_global_bound_fails_the_request_that_passes_it(store, worker):
    for key in ("a", "b", "c"):
        store.open(key)
    worker.step(("a", 0, 9), ("b", 0, 6))  # 15 of 16 rows held
    worker.step(("c", 0, 2))  # would make 17
    with pytest.raises(StatesOverflow, match="the stage passed"):
        store.take("c", timeout=5)
    assert store.held_bytes == 15 * ROW_BYTES
    assert positions(store.take("a")) == list(range(9))  # consuming frees room
    worker.step(("b", 6, 2))
    store.finish("b", 8)
    assert positions([store.collect("b")]) == list(range(8))


def test_stage_config_opt_in_configures_the_engine(omni_dir, monkeypatch):
    """`additional_config: {omni_thinker_states: {}}` on the thinker stage (the bundled tiny
    file sets it, for spoken answers to media prompts): the engine arguments the AR stage
    builds get our worker, prefix caching off, V1 runner, the layers (0 and the checkpoint's
    accept_hidden_layer) and the store's endpoint. Without it: untouched."""
    import json
    from pathlib import Path

    from vllm_omni_plugin.models import thinker_states as ts
    from vllm_omni_plugin.models.thinker_states.settings import WORKER_CLS, EngineSettings

    # Recorded so that the test's end restores it (attach sets it in this process).
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")
    tiny = Path(__file__).resolve().parents[2] / "stage_configs" / "qwen3_omni_tiny.yaml"
    kwargs = load_deploy_config(tiny, model=str(omni_dir)).stage(0).engine_kwargs()
    assert kwargs["additional_config"] == {ts.ADDITIONAL_CONFIG_KEY: {}}
    plain = {k: v for k, v in kwargs.items() if k != "additional_config"}
    assert ts.attach(dict(plain)) is None
    store = ts.attach(kwargs)
    try:
        assert kwargs["worker_cls"] == WORKER_CLS
        assert "enable_prefix_caching" not in kwargs  # vLLM's default (on) stays
        assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
        accept = json.loads((omni_dir / "config.json").read_text())["talker_config"][
            "accept_hidden_layer"
        ]
        settings = EngineSettings.from_additional_config(kwargs["additional_config"])
        assert settings == EngineSettings(layers=(0, accept), endpoint=store.endpoint)
    finally:
        store.close()
