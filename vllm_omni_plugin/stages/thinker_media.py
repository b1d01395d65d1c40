"""The thinker's hidden states a spoken answer to a prompt with audio, images or video needs.

The talker conditions on the thinker's hidden state at `accept_hidden_layer` for each media
position of the user turns (models/qwen3_omni/prompt.py), which only the thinker's own forward
computes. For such a prompt the chat stage opts the request into the extraction
(models/thinker_states), takes the prompt's states once the first token is out (the prefill
wrote them all), keeps the rows of the media positions and sends them as the request's first
chunk on the edge to the talker, before any ids: `[media positions, thinker hidden]` in the
thinker's dtype. The request's entry in the store is released then, so nothing more of it is
held (its decode steps' states are dropped as they arrive). A prompt without media costs
nothing: no extraction, no extra chunk.
"""

from __future__ import annotations

from typing import Any

import torch

from ..common.errors import RequestValidationError
from ..models import thinker_states

# How long the prompt's states may take to reach the store after the first token is out (they
# leave the worker in the same step, before its output): only a stuck or dead stage waits long.
PROMPT_STATES_TIMEOUT_S = 30.0


def media_token_ids(hf_config: Any) -> torch.Tensor:
    """The thinker's audio, image and video placeholder ids (a Qwen3-Omni config, or its
    thinker_config)."""
    cfg = getattr(hf_config, "thinker_config", hf_config)
    return torch.tensor([cfg.audio_token_id, cfg.image_token_id, cfg.video_token_id])


class ThinkerMedia:
    """One chat stage's side: which requests need the states, and taking them."""

    def __init__(self, store: thinker_states.ThinkerStatesStore | None, hf_config: Any):
        self.store = store
        try:
            self.media_ids = media_token_ids(hf_config)
        except AttributeError:  # not a Qwen3-Omni thinker: its prompts carry no such media
            self.media_ids = None

    def media_mask(self, prompt_ids: list[int]) -> torch.Tensor | None:
        """Bool `[L]`: the prompt's media positions; None when it has none."""
        if self.media_ids is None or not prompt_ids:
            return None
        mask = torch.isin(torch.tensor(prompt_ids), self.media_ids)
        return mask if bool(mask.any()) else None

    def opt_in(self, request_id: str, sampling_params: Any) -> None:
        """Extract this request's states (its prompt has media); a 400 when the stage was not
        configured to."""
        if self.store is None:
            raise RequestValidationError(
                "messages",
                "spoken answers to audio, image or video inputs need the thinker stage's "
                f"`additional_config: {{{thinker_states.ADDITIONAL_CONFIG_KEY}: {{}}}}`",
            )
        thinker_states.opt_in(sampling_params, request_id)
        self.store.open(request_id)

    async def take(self, request_id: str, mask: torch.Tensor) -> torch.Tensor:
        """`[mask.sum(), hidden]`: the states at the prompt's media positions (the prompt's
        prefill ran); the request's entry is released."""
        import asyncio

        store = self.store
        assert store is not None and store.accept_layer is not None
        try:
            store.finish(request_id, len(mask))  # the prompt's positions only
            states = await asyncio.to_thread(store.collect, request_id, PROMPT_STATES_TIMEOUT_S)
        except thinker_states.StatesOverflow as exc:
            if exc.own:  # this prompt alone is too big to hold (not the stage's load)
                raise RequestValidationError(
                    "messages",
                    f"the prompt is too long for a spoken answer ({exc}; the thinker stage's "
                    f"{thinker_states.ADDITIONAL_CONFIG_KEY}.max_request_bytes)",
                ) from None
            raise
        finally:
            store.release(request_id)
        hidden = states.layers[store.accept_layer]
        if states.start != 0 or hidden.shape[0] != len(mask):
            raise RuntimeError(
                f"thinker states of {request_id!r}: positions {states.start}.."
                f"{states.start + hidden.shape[0]} of a {len(mask)}-position prompt"
            )
        return hidden[mask].contiguous()
