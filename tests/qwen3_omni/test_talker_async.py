"""The talker engine under vLLM's async scheduling (models/qwen3_omni/talker_runner.py): vLLM
schedules step N + 1 before step N's output reaches the host, so the runner must take nothing
from the host that step N writes. Its frames equal the synchronous engine's, exactly, on the tiny
checkpoint: a batch with chunked prefills, an image prompt (3-D positions), a text streamed
through the text feed, an abort mid-way, and seeded sampling. The module starts two engines, one
after the other (about 50 s on two cores), and its tests compare what both wrote."""

from __future__ import annotations

import uuid

import pytest
import torch
from vllm_engines import shut_down

from vllm_omni_plugin.families.qwen3_omni import talker_hf_config
from vllm_omni_plugin.testing.qwen3_omni_reference import chat_input_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["Say hello.", "What is two plus two?", "Hi"]
# The thinker's answers the talker speaks: the short one runs past its text end (tts_eos, then
# tts_pad as text entries), the long ones do not.
ANSWERS = ["Hello there, nice to meet you!", "Two plus two is four.", "Hi."]
GREEDY = {"temperature": 0.0, "repetition_penalty": 1.0}
MAX_FRAMES = 12
ABORTED = "aborted"
ABORT_AFTER = 3  # frames the aborted request has written when the test aborts it
# Text ids sent to a streamed request each time the test reads the engine's outputs: the engine
# runs on in its own process, so its steps also wait on the feed for ids not sent yet.
STREAM_CHUNK = 3


@pytest.fixture(scope="module")
def talker_config(omni_dir):
    from transformers import Qwen3OmniMoeConfig

    return talker_hf_config(Qwen3OmniMoeConfig.from_pretrained(omni_dir))


@pytest.fixture(scope="module")
def requests(omni_dir, talker_config):
    """name -> (prompt embeddings, text ids, 3-D positions or None): three text prompts and an
    image prompt (the thinker's states at its image positions are random: the talker reads
    them as given)."""
    from transformers import AutoTokenizer

    from vllm_omni_plugin.models.qwen3_omni.positions import VisualGrid
    from vllm_omni_plugin.models.qwen3_omni.prompt import load_conditioner

    from .thinker_states_common import chat_prompt, processor_for, random_image

    conditioner = load_conditioner(omni_dir)
    tok = AutoTokenizer.from_pretrained(omni_dir)
    speaker = talker_config.speaker_id["ethan"]
    out = {}
    for i, (prompt, answer) in enumerate(zip(PROMPTS, ANSWERS, strict=True)):
        ids = chat_input_ids(omni_dir, prompt)[0].tolist()
        text = tok(answer)["input_ids"]
        out[f"text{i}"] = (conditioner.prefill(ids, text[0], speaker), text, None)
    with processor_for(omni_dir) as processor:
        chat = chat_prompt(
            processor, [{"type": "text", "text": "What is this?"}, {"type": "image"}]
        )
        inputs = processor(text=[chat], images=[random_image()], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    grids = [VisualGrid(*map(int, g)) for g in inputs["image_grid_thw"]]
    hidden_size = conditioner.config.thinker_config.text_config.hidden_size
    hidden = torch.randn(
        conditioner.media_positions(ids), hidden_size, generator=torch.Generator().manual_seed(0)
    )
    text = tok(ANSWERS[0])["input_ids"]
    prefill = conditioner.prefill(ids, text[0], speaker, hidden)
    out["image"] = (prefill, text, conditioner.positions(ids, grids))
    return out


def _engine(omni_dir, async_scheduling: bool, text_endpoint: str):
    from vllm import LLM

    from vllm_omni_plugin.models.qwen3_omni.talker_runner import talker_engine_args
    from vllm_omni_plugin.models.qwen3_omni.text_feed import ADDITIONAL_CONFIG_KEY

    return LLM(
        model=str(omni_dir),
        **{**talker_engine_args(), "async_scheduling": async_scheduling},
        additional_config={ADDITIONAL_CONFIG_KEY: {"endpoint": text_endpoint}},
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=4,
        # Prefills of 16-30 positions: all but the shortest prompt prefill in chunks, in steps
        # shared with other requests' chunks and decode steps.
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        seed=0,
    )


def _run(llm, talker_config, requests, abort=None, streamed=(), sender=None, **sampling):
    """Runs `requests` (name -> request) in one batch through the engine, step by step,
    aborting request `abort` once it has written ABORT_AFTER frames; the text of the
    `streamed` ones goes through the engine's text feed (`sender`), STREAM_CHUNK ids before
    each step -> name -> frames `[G, n]`."""
    from vllm_omni_plugin.models.qwen3_omni.talker_runner import (
        frame_sampling_params,
        frames_from_logprobs,
    )

    engine = llm.llm_engine
    streams = {}
    for name, (prefill, text, positions) in requests.items():
        if name in streamed:
            key = f"{name}-{uuid.uuid4().hex[:8]}"  # the feed remembers closed keys
            streams[key], text = list(text), key
        params = frame_sampling_params(talker_config, text, MAX_FRAMES, positions, **sampling)
        engine.add_request(name, {"prompt_embeds": prefill}, params)
    last = {}
    while engine.has_unfinished_requests():
        for key, ids in streams.items():
            if ids:
                sender.send(key, ids[:STREAM_CHUNK], final=len(ids) <= STREAM_CHUNK)
                del ids[:STREAM_CHUNK]
        for out in engine.step():
            last[out.request_id] = out.outputs[0]
            done = len(out.outputs[0].token_ids)
            if out.request_id == abort and done >= ABORT_AFTER and not out.finished:
                engine.abort_request([abort])
    for key in streams:
        sender.close_request(key)
    frames = {}
    for name, out in last.items():
        f = frames_from_logprobs(
            out.logprobs,
            talker_config.text_config.vocab_size,
            talker_config.code_predictor_config.vocab_size,
            talker_config.num_code_groups,
        )
        assert f.shape[1] == len(out.token_ids)
        frames[name] = f
    return frames


def _scenarios(llm, talker_config, requests, sender) -> dict[str, dict[str, torch.Tensor]]:
    batch = {name: requests[name] for name in ("text0", "text1", "image")}
    aborting = {**batch, ABORTED: requests["text1"]}
    seeded = {"text2": requests["text2"]}
    return {
        "greedy": _run(llm, talker_config, batch, **GREEDY),
        "streamed": _run(llm, talker_config, batch, streamed={"text0"}, sender=sender, **GREEDY),
        "abort": _run(llm, talker_config, aborting, abort=ABORTED, **GREEDY),
        # The checkpoint's sampling (temperature, top-k, top-p, repetition penalty). Only the
        # prompt that prefills in one step: vLLM's CPU runner cannot rewind a seeded CPU
        # generator after a discarded prefill chunk.
        "seed 7": _run(llm, talker_config, seeded, seed=7),
        "seed 7 again": _run(llm, talker_config, seeded, seed=7),
        "seed 8": _run(llm, talker_config, seeded, seed=8),
    }


@pytest.fixture(scope="module")
def sender():
    """The stage's end of the talker's text feed (text_feed.py)."""
    from vllm_omni_plugin.models.qwen3_omni.text_feed import TextSender

    sender = TextSender()
    yield sender
    sender.close()


@pytest.fixture(scope="module")
def sync_frames(omni_dir, talker_config, requests, sender):
    llm = _engine(omni_dir, async_scheduling=False, text_endpoint=sender.endpoint)
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is False
        return _scenarios(llm, talker_config, requests, sender)
    finally:
        shut_down(llm)  # before the async engine starts


@pytest.fixture(scope="module")
def async_frames(omni_dir, talker_config, requests, sender, sync_frames, async_on_cpu):
    # After the synchronous engine's run (`sync_frames`): one engine at a time on the machine.
    with pytest.MonkeyPatch.context() as mp:
        # The check below sends a function to the worker process.
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        llm = _engine(omni_dir, async_scheduling=True, text_endpoint=sender.endpoint)
        try:
            assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is True
            # What the worker's talker runner itself runs: vLLM's async paths.
            (runner,) = llm.collective_rpc(_runner_mode)
            assert runner[0].startswith("Talker") and runner[1] is True, runner
            return _scenarios(llm, talker_config, requests, sender)
        finally:
            shut_down(llm)


def _runner_mode(worker) -> tuple[str, bool]:
    return type(worker.model_runner).__name__, worker.model_runner.use_async_scheduling


def test_async_greedy_batch_equals_sync(sync_frames, async_frames):
    """Two text prompts and an image prompt in one batch, two of them prefilled in chunks
    across steps shared with decode steps: every code group of every frame equals the
    synchronous engine's."""
    want, got = sync_frames["greedy"], async_frames["greedy"]
    assert want.keys() == got.keys() == {"text0", "text1", "image"}
    for name, frames in want.items():
        assert frames.shape[1] > 2, name
        assert torch.equal(got[name], frames), name


def test_async_streamed_text_equals_sync(sync_frames, async_frames):
    """The first request's text streamed through the engine's text feed, a few ids before each
    step and complete partway (its frames then read tts_eos, then tts_pad): the same frames as
    with the whole text up front, in both modes."""
    want = sync_frames["greedy"]
    for frames in (sync_frames["streamed"], async_frames["streamed"]):
        assert frames.keys() == want.keys()
        for name, f in frames.items():
            assert torch.equal(f, want[name]), name


def test_async_abort_leaves_the_batch_as_sync(sync_frames, async_frames):
    """A request aborted after a few frames: the batch's other requests write what they write
    without it, in both modes, and the aborted one wrote a prefix of its uninterrupted frames
    (async scheduling may run it one step further before the abort lands)."""
    alone = sync_frames["greedy"]
    for frames in (sync_frames["abort"], async_frames["abort"]):
        for name, want in alone.items():
            assert torch.equal(frames[name], want), name
        aborted = frames[ABORTED]
        assert ABORT_AFTER <= aborted.shape[1] < alone["text1"].shape[1]
        assert torch.equal(aborted, alone["text1"][:, : aborted.shape[1]])


def test_async_seeded_sampling_equals_sync(sync_frames, async_frames):
    """The checkpoint's sampling with a seed: the same frames as the synchronous engine with the
    same seed, again with it, and other frames with another seed."""
    first = sync_frames["seed 7"]["text2"]
    assert first.shape[1] > 1
    assert torch.equal(async_frames["seed 7"]["text2"], first)
    assert torch.equal(async_frames["seed 7 again"]["text2"], first)
    assert torch.equal(async_frames["seed 8"]["text2"], sync_frames["seed 8"]["text2"])
    assert not torch.equal(async_frames["seed 8"]["text2"], first)
