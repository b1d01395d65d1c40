"""Text generation on an AR stage for vLLM's own chat and completion handlers.

A GenerateText message carries vLLM's EngineCoreRequest, already rendered and processed in the
API server by vLLM's own renderer and InputProcessor (serving/text_engine.py), encoded with
vLLM's own msgpack encoder, as vLLM's front end sends it to its engine core. The stage's
AsyncLLM generates it; each RequestOutput goes back as a TextOutput (plain data), and a Result
ends the request. Cancelling the task (an Abort: the client hung up) aborts it in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..common.messages import Result
from ..common.text_messages import GenerateText, TextCompletion, TextOutput

logger = logging.getLogger("vllm_omni_plugin.stages.ar")

PlainLogprobs = dict[int, tuple[float, int | None, str | None]]


def plain_logprobs(positions: Iterable[Any] | None) -> list[PlainLogprobs | None] | None:
    """vLLM's logprobs (a list or FlatLogprobs of {token id: Logprob} per position) as plain
    data: {token id: (logprob, rank, decoded token)} per position."""
    if positions is None:
        return None
    out: list[PlainLogprobs | None] = []
    for position in positions:
        if position is None:
            out.append(None)
            continue
        out.append(
            {int(t): (float(lp.logprob), lp.rank, lp.decoded_token) for t, lp in position.items()}
        )
    return out


def to_text_output(request_id: str, out: Any, first: bool) -> TextOutput:
    """A vLLM RequestOutput as a TextOutput (prompt fields only on the request's first)."""
    completions = [
        TextCompletion(
            index=c.index,
            text=c.text,
            token_ids=list(c.token_ids),
            cumulative_logprob=c.cumulative_logprob,
            logprobs=plain_logprobs(c.logprobs),  # type: ignore[arg-type]
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in out.outputs
    ]
    return TextOutput(
        request_id=request_id,
        outputs=completions,
        finished=bool(out.finished),
        prompt_token_ids=list(out.prompt_token_ids or []) if first else None,
        prompt_logprobs=plain_logprobs(out.prompt_logprobs) if first else None,
        num_cached_tokens=out.num_cached_tokens,
    )


async def run_text(
    engine: Any,
    msg: GenerateText,
    send: Callable[[Any], None],
    pulse: Callable[[], None],
) -> Result | None:
    """Generate `msg` on `engine` (a vLLM AsyncLLM), sending each output with `send`.
    Returns the closing Result, or None when cancelled (aborted)."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder

    t0 = time.perf_counter()
    rid = msg.request_id
    try:
        request = MsgpackDecoder(EngineCoreRequest).decode(msg.engine_request)
        delta = request.sampling_params.output_kind == RequestOutputKind.DELTA
        first = True
        generated = 0
        async for out in engine.generate(
            request, request.sampling_params, rid, prompt_text=msg.prompt_text
        ):
            pulse()
            send(to_text_output(rid, out, first))
            first = False
            tokens = sum(len(c.token_ids) for c in out.outputs)
            generated = generated + tokens if delta else tokens
        result = Result(rid, metrics={"generated_tokens": generated})
    except asyncio.CancelledError:
        return None  # AsyncLLM.generate aborted the request in the engine
    except Exception as exc:
        logger.exception("text request %s failed", rid)
        result = Result(rid, error=f"{type(exc).__name__}: {exc}")
    result.stage_s = time.perf_counter() - t0
    return result


async def speak_chat(stage: Any, msg: Any) -> Result:
    """A speech request (GenerationParams.chat_request) on the pipeline's chat stage: vLLM's
    EngineCoreRequest as the API server built it, generated here; each text delta goes to the
    API server as a TextOutput (the transcript) and, as this stage's output, on to the next
    stage: with a streamed edge (`stream_output`) a chunk of the new token ids (int64 tensor)
    per delta, else all ids in one payload at the end. The consumer reads the prompt ids and
    the voice from the same params (`chat_request`, `voice`).

    A prompt with audio, images or video (on a streamed edge) first sends the thinker's hidden
    states at its media positions, once its prefill ran (stages/thinker_media.py)."""
    import torch
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder

    rid = msg.request_id
    request = MsgpackDecoder(EngineCoreRequest).decode(msg.params.chat_request)
    request.sampling_params.output_kind = RequestOutputKind.DELTA  # pieces, as they come
    streamed = bool(stage.init.spec.stream_output)
    media = stage.thinker_media.media_mask(list(request.prompt_token_ids or []))
    if media is not None and streamed:
        stage.thinker_media.opt_in(rid, request.sampling_params)
    else:
        media = None
    ids: list[int] = []
    first = True
    async for out in stage.engine.generate(
        request, request.sampling_params, rid, prompt_text=msg.params.prompt or None
    ):
        stage.pulse()
        if media is not None:  # the prompt's prefill ran: its states go first
            await stage.emit_chunk(msg, await stage.thinker_media.take(rid, media))
            media = None
        stage.reply(to_text_output(rid, out, first))
        first = False
        new = list(out.outputs[0].token_ids) if out.outputs else []
        ids.extend(new)
        if streamed and new:
            await stage.emit_chunk(msg, torch.tensor(new, dtype=torch.int64))
    output = None
    if not streamed:
        output = stage.payloads.emit(
            torch.tensor(ids, dtype=torch.int64),
            rid,
            stage.stage_id,
            msg.to_stage,
            msg.out_connector,
        )
    return Result(rid, output=output, metrics={"generated_tokens": len(ids)})
