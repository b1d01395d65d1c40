"""vLLM text generation on a pipeline's chat stage (serving/text_engine.py, stages/ar_text.py).

Part of the one message schema: common/messages.py's unions carry GenerateText (to a stage) and
TextOutput (from it), encoded as every other message.
"""

from __future__ import annotations

import msgspec

# ---- vLLM text generation on a pipeline's chat stage (serving/text_engine.py) -----------------
# A text-only chat or completion request runs on the pipeline's chat stage alone (Qwen3-Omni's
# thinker), exactly as vLLM's own server runs it: the API server renders and processes the
# request with vLLM's own renderer and InputProcessor into vLLM's EngineCoreRequest, the stage's
# AsyncLLM generates, and each RequestOutput comes back as a TextOutput. The stage replies with a
# Result when the generation ends (error set if it failed).
PlainLogprobs = dict[int, tuple[float, int | None, str | None]]


class GenerateText(msgspec.Struct, tag=True):
    """Generate text for one vLLM request on an AR stage.

    `engine_request`: vLLM's EngineCoreRequest as vLLM's own msgpack encoder writes it for its
    engine core (`vllm.v1.serial_utils.MsgpackEncoder.encode`: the message, then one buffer per
    tensor of its multimodal features); the stage decodes it with vLLM's MsgpackDecoder.
    `prompt_text`: the prompt's text where vLLM's server knows it (RequestOutput.prompt)."""

    request_id: str
    engine_request: list[bytes]
    prompt_text: str | None = None


class TextCompletion(msgspec.Struct):
    """vLLM's CompletionOutput as plain data. `logprobs`: per generated token, the candidate
    token ids with (logprob, rank, decoded token); None when not requested."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PlainLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class TextOutput(msgspec.Struct, tag=True):
    """One vLLM RequestOutput of a GenerateText request (or of a speech request's chat stage),
    as plain data: what vLLM's RequestOutput holds that its OpenAI server reads.
    `prompt_token_ids` and `prompt_logprobs` come once, on the first output."""

    request_id: str
    outputs: list[TextCompletion]
    finished: bool
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[PlainLogprobs | None] | None = None
    num_cached_tokens: int | None = None
