"""A pipeline's chat stage answers /v1/chat/completions and /v1/completions as stock `vllm serve`
of the same model does (vLLM's own chat machinery, not a copy).

Two real servers of one tiny model (conftest.py `chat_servers`): stock vLLM, and our plugin
serving a one-stage pipeline whose chat stage is that model. Greedy requests through the official
`openai` client must give the same tokens, text, logprobs (exactly: the same vLLM engine code on
the same weights), finish reasons and usage; streamed deltas must join to the same text. Requests
for speech get OpenAI-shaped 400s from a deployment that does not speak, and a client that hangs up
mid-stream frees the chat stage.
"""

from __future__ import annotations

import time

import httpx
import openai
import psutil
import pytest
from omni_server import API_KEY

pytestmark = pytest.mark.slow

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def chat(server, **kw):
    return client(server).chat.completions.create(
        model=server.model, messages=MESSAGES, temperature=0, **kw
    )


def test_chat_equals_stock_vllm_same_tokens_logprobs_within_1e4(chat_servers):
    """Same tokens and text, finish reason and usage as stock vLLM; the top-2 logprobs of each
    token within 1e-4 (the same vLLM engine code and weights; two engine processes may order
    their CPU reductions differently).

    Over 60 s on 2 cores: as the module's first test it waits for both servers' start-ups,
    ours (API server, chat stage, its vLLM engine core) and stock `vllm serve`, side by side."""
    ours, stock = chat_servers
    kw = {"max_tokens": 12, "logprobs": True, "top_logprobs": 2, "seed": 3}
    a, b = chat(ours, **kw), chat(stock, **kw)
    ca, cb = a.choices[0], b.choices[0]
    assert ca.message.content == cb.message.content
    assert ca.finish_reason == cb.finish_reason
    assert a.usage == b.usage and a.usage.completion_tokens > 0
    assert a.model == b.model == ours.model

    def tops(choice):
        return [
            [(t.token, t.logprob)] + [(x.token, x.logprob) for x in t.top_logprobs]
            for t in choice.logprobs.content
        ]

    ta, tb = tops(ca), tops(cb)
    assert [[tok for tok, _ in p] for p in ta] == [[tok for tok, _ in p] for p in tb]
    for pa, pb in zip(ta, tb, strict=True):
        for (_, la), (_, lb) in zip(pa, pb, strict=True):
            assert abs(la - lb) <= 1e-4


def test_streamed_chat_equals_stock_vllm(chat_servers):
    ours, stock = chat_servers

    def streamed(server):
        pieces, usage, finish = [], None, None
        for chunk in chat(
            server, max_tokens=10, stream=True, stream_options={"include_usage": True}
        ):
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return "".join(pieces), usage, finish, len([p for p in pieces if p])

    text, usage, finish, n = streamed(ours)
    assert (text, usage, finish) == streamed(stock)[:3]
    assert n >= 1


def test_completions_and_models_equal_stock_vllm(chat_servers):
    ours, stock = chat_servers

    def complete(server):
        return client(server).completions.create(
            model=server.model,
            prompt="red green",
            max_tokens=6,
            temperature=0,
            logprobs=2,
            echo=True,
        )

    a, b = complete(ours), complete(stock)
    assert a.choices[0].text == b.choices[0].text  # the prompt echoed, then the same tokens
    assert a.choices[0].logprobs.tokens == b.choices[0].logprobs.tokens
    la, lb = a.choices[0].logprobs.token_logprobs, b.choices[0].logprobs.token_logprobs
    assert [x is None for x in la] == [x is None for x in lb]
    assert all(abs(x - y) <= 1e-4 for x, y in zip(la, lb, strict=True) if x is not None)
    assert a.usage == b.usage
    assert [m.id for m in client(ours).models.list()] == [m.id for m in client(stock).models.list()]


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "x" * 4200}]},  # over max_model_len 4096
        {"messages": MESSAGES, "temperature": -1.0},  # vLLM's SamplingParams refuses it
    ],
)
def test_vllm_validation_errors_as_stock(chat_servers, body):
    """vLLM's own 400s, word for word, from the API server before the stage is asked."""
    r = [
        httpx.post(
            f"{s.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={"model": s.model, "max_tokens": 4, **body},
            timeout=60,
        )
        for s in chat_servers
    ]
    assert r[0].status_code == r[1].status_code == 400, r[0].text
    assert r[0].json() == r[1].json()


@pytest.mark.parametrize(
    "extra",
    [
        {"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}},
        {"audio": {"voice": "ethan", "format": "wav"}},
    ],
)
def test_speech_from_a_text_only_deployment_is_a_400(chat_servers, extra):
    ours, _ = chat_servers
    with pytest.raises(openai.BadRequestError) as err:
        chat(ours, max_tokens=4, extra_body=extra)
    body = err.value.body
    assert body["param"] == "modalities" and body["type"] == "invalid_request_error"


def _live(server) -> dict:
    r = httpx.get(
        f"{server.url}/v1/omni/stages?live=1", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    return r.json()["stages"][0]["live"]


def _metrics(server) -> dict[str, float]:
    """/metrics samples by name (summed over labels) for the pipeline's stage 0 and ours."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("stage_id", "0") == "0":
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _generated(server) -> float:
    """The stage's own vLLM count of generated tokens, as relayed to /metrics (every 2 s)."""
    return _metrics(server).get("vllm:generation_tokens_total", 0.0)


MAX_TOKENS = 4000


def _settled_generated(server) -> float:
    """The stage's token counter once the relay has caught up: two readings one relay period
    (2 s) apart agree."""
    previous = _generated(server)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(2.5)
        now = _generated(server)
        if now == previous:
            return now
        previous = now
    raise TimeoutError(f"vllm:generation_tokens_total still moving: {previous}")


def _engine_core(server) -> psutil.Process:
    stage = next(p for p in server.descendants() if "omni-stage-0" in " ".join(p.cmdline()))
    return next(p for p in stage.children(recursive=True) if "EngineCore" in p.name())


def test_hang_up_mid_stream_frees_the_chat_stage(chat_servers):
    """The client closes a long greedy stream (ignore_eos, 4000 tokens) after its first chunk:
    the stage's vLLM engine then holds no request, and the engine's own token counter shows it
    stopped well short of the 4000 tokens it would have written.

    The engine core is paused (SIGSTOP) from the first chunk until the stage has dropped the
    request, so the abort is waiting for it when it resumes: without the pause a fast engine
    could finish the whole answer before a hang-up on a loaded machine reaches it, and the
    test would measure that race instead of the abort."""
    ours, _ = chat_servers
    before = _settled_generated(ours)
    assert before > 0  # the earlier tests' tokens: the stage's counter reaches /metrics
    core = _engine_core(ours)
    stream = chat(ours, max_tokens=MAX_TOKENS, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    core.suspend()
    try:
        assert _live(ours)["engine_unfinished"] == 1
        stream.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            live = _live(ours)
            if live["engine_unfinished"] == 0 and not live["requests"]:
                break
            time.sleep(0.1)
        assert live["engine_unfinished"] == 0 and not live["requests"], live
    finally:
        core.resume()
    assert _settled_generated(ours) - before < MAX_TOKENS / 2
    # The stage still answers.
    assert chat(ours, max_tokens=2).choices[0].message.content is not None


def test_metrics_show_the_stage_and_the_speech_histograms(chat_servers):
    ours, _ = chat_servers
    samples = _metrics(ours)
    assert samples["omni_stage_up"] == 1.0
    assert samples["omni_stage_requests_completed_total"] >= 1
    # Speech latency families exist (empty on a deployment that does not speak).
    assert samples["omni_speech_time_to_first_audio_seconds_count"] == 0
    assert samples["omni_speech_real_time_factor_count"] == 0
    assert samples["omni_speech_requests_total"] >= 2  # the 400s above
