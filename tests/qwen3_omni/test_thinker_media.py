"""The chat stage's side of spoken answers to media prompts (stages/thinker_media.py): which
prompts need the thinker's states, the opt-in (a 400 without the stage's extraction), and the
media rows taken out of the real store, fed over a real ZMQ socket as vLLM's worker feeds it.
No engine (tests/serving/test_qwen3_omni_serve.py runs it served)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams

from vllm_omni_plugin.common.errors import RequestValidationError
from vllm_omni_plugin.models.thinker_states import REQUEST_KEY, ThinkerStatesStore
from vllm_omni_plugin.stages.thinker_media import ThinkerMedia

from .test_thinker_states_store import DIM, LAYERS, Worker

AUDIO, IMAGE, VIDEO = 405, 408, 409
CONFIG = SimpleNamespace(
    thinker_config=SimpleNamespace(audio_token_id=AUDIO, image_token_id=IMAGE, video_token_id=VIDEO)
)
PROMPT = [1, 2, AUDIO, AUDIO, AUDIO, 3, IMAGE, 4, 5]


@pytest.fixture
def store():
    s = ThinkerStatesStore(accept_layer=LAYERS[1])
    yield s
    s.close()


def test_prompts_with_media_need_the_states_and_a_stage_without_them_refuses():
    media = ThinkerMedia(None, CONFIG)
    assert media.media_mask([1, 2, 3]) is None
    mask = media.media_mask(PROMPT)
    assert mask.tolist() == [p in (AUDIO, IMAGE) for p in PROMPT]
    with pytest.raises(RequestValidationError, match="omni_thinker_states") as err:
        media.opt_in("r", SamplingParams())
    assert err.value.field == "messages"
    # A model that is not a Qwen3-Omni thinker has no media placeholders to look for.
    assert ThinkerMedia(None, SimpleNamespace()).media_mask(PROMPT) is None


def test_take_returns_the_media_rows_of_the_accept_layer_and_releases(store):
    """The prompt's states arrive in two prefill chunks and a decode step: the rows of the
    media positions of the accept layer (not layer 0), in order; nothing stays held."""
    media = ThinkerMedia(store, CONFIG)
    params = SamplingParams()
    media.opt_in("r", params)
    assert params.extra_args[REQUEST_KEY] == "r"
    worker = Worker(store.endpoint)
    try:
        worker.step(("r", 0, 4))
        worker.step(("r", 4, 5))
        worker.step(("r", 9, 1))
        mask = media.media_mask(PROMPT)
        got = asyncio.run(media.take("r", mask))
    finally:
        worker.close()
    # The worker's rows hold their position; the accept layer is sent negated.
    positions = torch.tensor([2, 3, 4, 6], dtype=torch.float32)
    torch.testing.assert_close(got, -positions[:, None].expand(4, DIM))
    assert store.held_bytes == 0 and store.keys() == []


def test_a_prompt_too_big_to_hold_is_a_400_naming_the_bound():
    """A prompt whose states pass the request's `max_request_bytes` fails with a 400 naming
    the setting (its states are dropped, nothing stays held)."""
    row = DIM * 4 * len(LAYERS)
    store = ThinkerStatesStore(max_request_bytes=6 * row, accept_layer=LAYERS[1])
    worker = Worker(store.endpoint)
    try:
        media = ThinkerMedia(store, CONFIG)
        media.opt_in("big", SamplingParams())
        worker.step(("big", 0, 9))  # the whole prompt in one prefill step
        with pytest.raises(RequestValidationError, match="max_request_bytes") as err:
            asyncio.run(media.take("big", media.media_mask(PROMPT)))
        assert err.value.field == "messages"
        assert store.held_bytes == 0 and store.keys() == []
    finally:
        worker.close()
        store.close()
