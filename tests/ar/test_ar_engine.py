"""GLM-Image AR on stock vLLM (offline LLM, real engine processes) against transformers.

One engine at a time (2 cores, ~3 GB each): the sync-mode engine for the first tests, then the
async engine (async scheduling re-enabled, since vLLM's CPU platform turns it off), then a
configuration that must be refused before any engine starts. Tests run in file order and share
results through `RESULTS`.
"""

from __future__ import annotations

import gc

import pytest
from vllm_engines import shut_down

from vllm_omni_plugin.families.glm_image.processing import (
    build_t2i_prompt,
    num_image_tokens,
    t2i_sampling_overrides,
    tokens_to_prior_token_ids,
)
from vllm_omni_plugin.models.glm_image import LOGITS_PROCESSOR

PROMPT = "a red cat"  # the prompt tests/ar/conftest.py uses for references
ASYNC_SCHED = "vllm_omni_plugin.core.sched.OmniARAsyncScheduler"
SYNC_SCHED = "vllm_omni_plugin.core.sched.OmniARScheduler"
HF_SIZES = [(64, 64), (64, 96)]
# Batch of 8: mixed sizes (preview + large grid: 247..261 codes each), one seed each.
BATCH = [(64, 64), (64, 96), (96, 32), (32, 128), (96, 96), (128, 64), (32, 32), (64, 160)]
RESULTS: dict[str, object] = {}
pytestmark = pytest.mark.slow


def _engine_kwargs(glm_tiny, **extra):
    # The logits processor as the AR stage passes it (pipelines/glm_image.py).
    return dict(
        logits_processors=[LOGITS_PROCESSOR],
        model=glm_tiny.ar,
        tokenizer=glm_tiny.processor,
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=8,
        **extra,
    )


class EngineSlot:
    """At most one live LLM; asking for another shuts the current one down first."""

    def __init__(self):
        self.name, self.llm = None, None

    def get(self, name, factory):
        if self.name != name:
            self.close()
            self.llm, self.name = factory(), name
        return self.llm

    def close(self):
        if self.llm is not None:
            shut_down(self.llm)
            self.llm, self.name = None, None
            gc.collect()


@pytest.fixture(scope="module", autouse=True)
def engine_core_process():
    """vLLM's engine core in a process of its own, as `LLM` runs it by default (the suite runs
    it in-process): the tests read what it logs at start-up from the stderr it inherits."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        yield


@pytest.fixture(scope="module")
def slot():
    s = EngineSlot()
    yield s
    s.close()


@pytest.fixture
def sync_llm(slot, glm_tiny):
    from vllm import LLM

    # The hidden-check configuration: OmniARAsyncScheduler, async turned off by the platform.
    return slot.get("sync", lambda: LLM(**_engine_kwargs(glm_tiny, scheduler_cls=ASYNC_SCHED)))


@pytest.fixture
def async_llm(slot, glm_tiny, async_on_cpu):
    from vllm import LLM

    factory = lambda: LLM(  # noqa: E731
        **_engine_kwargs(glm_tiny, scheduler_cls=ASYNC_SCHED, async_scheduling=True)
    )
    return slot.get("async", factory)


def _prompts(glm_tiny, sizes):
    return [
        {"prompt_token_ids": build_t2i_prompt(glm_tiny.processor, PROMPT, h, w)} for h, w in sizes
    ]


def _constrained(glm_tiny, sizes, **params):
    from vllm import SamplingParams

    return [SamplingParams(**params, **t2i_sampling_overrides(glm_tiny.ar, h, w)) for h, w in sizes]


def _tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def _assert_valid_grid(tokens, height, width):
    n = num_image_tokens(height, width)
    assert len(tokens) == n + 1, (height, width, len(tokens))
    assert all(0 <= t < 64 for t in tokens[:n]), "non-code id inside the grid"
    assert tokens[-1] == 65  # EOS exactly after the grid


def _run_batch(llm, glm_tiny):
    """Greedy batch (HF sizes first) + seeded sampling batch of 8 mixed sizes."""
    greedy = llm.generate(_prompts(glm_tiny, BATCH), _constrained(glm_tiny, BATCH, temperature=0))
    sampled = [
        _constrained(glm_tiny, [size], temperature=1.0, seed=100 + i)[0]
        for i, size in enumerate(BATCH)
    ]
    return greedy, llm.generate(_prompts(glm_tiny, BATCH), sampled)


# ---- sync mode (OmniARAsyncScheduler with async scheduling off) ----


def test_sync_mode_greedy_equals_transformers(capfd, sync_llm, glm_tiny, hf_greedy):
    from vllm import SamplingParams

    # capfd comes first: it sees the engine start (EngineCore logs to the inherited stderr).
    start_log = capfd.readouterr()
    assert "OmniARAsyncScheduler: async scheduling is off" in start_log.out + start_log.err
    assert sync_llm.llm_engine.vllm_config.scheduler_config.async_scheduling is False
    prompts = _prompts(glm_tiny, HF_SIZES)
    # Plain greedy, as a user would call it: budget = grid + EOS, nothing else.
    plain = [
        SamplingParams(temperature=0, max_tokens=num_image_tokens(h, w) + 1) for h, w in HF_SIZES
    ]
    constrained = _constrained(glm_tiny, HF_SIZES, temperature=0)
    for params in (plain, constrained):
        got = _tokens(sync_llm.generate(prompts, params))
        for (h, w), tokens in zip(HF_SIZES, got, strict=True):
            assert tokens == hf_greedy(h, w), (h, w)
            _assert_valid_grid(tokens, h, w)


def test_sync_batch_of_8_mixed_sizes(sync_llm, glm_tiny, hf_greedy):
    greedy, sampled = _run_batch(sync_llm, glm_tiny)
    RESULTS["sync_batch"] = (_tokens(greedy), _tokens(sampled))
    for i, (h, w) in enumerate(BATCH):
        for out in (greedy[i], sampled[i]):
            tokens = list(out.outputs[0].token_ids)
            _assert_valid_grid(tokens, h, w)
            # What the AR stage hands on: the finished output's full token history.
            prior = tokens_to_prior_token_ids(tokens, h, w)
            assert prior.shape == (1, 4 * (h // 32) * (w // 32))
    for i, size in enumerate(HF_SIZES):  # batched greedy == transformers (batch 1)
        assert list(greedy[i].outputs[0].token_ids) == hf_greedy(*size)
    # Seeds are per request: the same request alone samples the same tokens.
    alone = sync_llm.generate(
        _prompts(glm_tiny, [BATCH[5]]),
        _constrained(glm_tiny, [BATCH[5]], temperature=1.0, seed=105),
    )
    assert _tokens(alone)[0] == _tokens(sampled)[5]
    assert len({tuple(t) for t in _tokens(sampled)}) == len(BATCH)


def _abort_mid_flight(llm, glm_tiny):
    """8 requests; abort some right away, some mid-decode; the rest must finish intact."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = _constrained(glm_tiny, BATCH, temperature=0)
    for i, (prompt, p) in enumerate(zip(_prompts(glm_tiny, BATCH), params, strict=True)):
        engine.add_request(f"abort-{i}", prompt, p)
    engine.abort_request(["abort-1"])  # before it is ever scheduled (or during prefill)
    finished, steps, aborted_mid = {}, 0, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 20 and not aborted_mid:  # decode is running: abort while steps fly
            engine.abort_request(["abort-2", "abort-6"])
            aborted_mid = True
    # The engine still serves afterwards (generation_config's forced EOS ends the 3rd token).
    again = llm.generate(
        _prompts(glm_tiny, [BATCH[0]]), SamplingParams(temperature=0, max_tokens=3)
    )
    return finished, _tokens(again)[0]


def test_sync_abort_mid_step(sync_llm, glm_tiny):
    finished, again = _abort_mid_flight(sync_llm, glm_tiny)
    greedy = RESULTS["sync_batch"][0]
    survivors = {f"abort-{i}" for i in (0, 3, 4, 5, 7)}
    assert survivors <= set(finished)
    for rid in survivors:
        assert finished[rid] == greedy[int(rid.split("-")[1])]
    for rid in ("abort-1", "abort-2", "abort-6"):
        assert len(finished.get(rid, [])) < num_image_tokens(*BATCH[int(rid[-1])]) + 1
    assert again == greedy[0][:2] + [65]


# ---- async scheduling on ----


def test_ignore_eos_request_gets_no_forced_eos(sync_llm, glm_tiny):
    # Free generation (no image-grid constraint): the checkpoint's generation_config forces EOS
    # (65) as the last budgeted token, and its sequence_bias keeps 65 from ever being picked
    # otherwise. With ignore_eos=True the same greedy run must end on its own last token.
    from vllm import SamplingParams

    def greedy(**extra):
        params = SamplingParams(temperature=0, max_tokens=12, detokenize=False, **extra)
        return _tokens(sync_llm.generate(_prompts(glm_tiny, [(64, 64)]), params))[0]

    forced, free = greedy(), greedy(ignore_eos=True)
    assert len(forced) == 12 and forced[-1] == 65, forced
    assert len(free) == 12 and free[-1] != 65, free
    assert free[:-1] == forced[:-1]  # one greedy run; only the forced last token differs


def test_async_outputs_identical_to_sync(async_llm, glm_tiny):
    assert async_llm.llm_engine.vllm_config.scheduler_config.async_scheduling is True
    greedy, sampled = _run_batch(async_llm, glm_tiny)
    assert (_tokens(greedy), _tokens(sampled)) == RESULTS["sync_batch"]


def test_async_abort_mid_step(async_llm, glm_tiny):
    finished, again = _abort_mid_flight(async_llm, glm_tiny)
    greedy = RESULTS["sync_batch"][0]
    for i in (0, 3, 4, 5, 7):
        assert finished[f"abort-{i}"] == greedy[i]
    for i in (1, 2, 6):
        assert len(finished.get(f"abort-{i}", [])) < num_image_tokens(*BATCH[i]) + 1
    assert again == greedy[0][:2] + [65]


# ---- the pairing that crashed production: refused where the config is built ----


def test_sync_scheduler_under_async_is_refused(slot, glm_tiny, async_on_cpu, capfd):
    """vLLM's own engine creation, refused as a config error once its config is final (async
    kept on), before an engine core starts or the model loads."""
    from vllm import LLM

    from vllm_omni_plugin.config.scheduler import SchedulerPairError

    slot.close()
    capfd.readouterr()
    with pytest.raises(SchedulerPairError) as refused:
        LLM(**_engine_kwargs(glm_tiny, scheduler_cls=SYNC_SCHED, async_scheduling=True))
    said = str(refused.value)
    assert "OmniARScheduler is a synchronous scheduler but async scheduling is on" in said
    assert "async_scheduling is true" in said and "remove scheduler_cls" in said  # the settings
    # No engine core started: it logs its config first thing (to the stderr it inherits).
    captured = capfd.readouterr()
    assert "Initializing a V1 LLM engine" not in captured.out + captured.err
