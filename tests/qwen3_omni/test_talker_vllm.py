"""The talker as a vLLM model (models/qwen3_omni/talker.py, talker_runner.py), run by vLLM's own
engine on the CPU against transformers' `generate` on the tiny checkpoint."""

from __future__ import annotations

import pytest
import torch
from vllm_engines import shut_down

from vllm_omni_plugin.families.qwen3_omni import talker_hf_config
from vllm_omni_plugin.testing.qwen3_omni_reference import chat_input_ids, reference_generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["Say hello.", "What is two plus two?", "Hi"]
# The reference's settings (testing/qwen3_omni_reference.py): greedy, no repetition penalty.
GREEDY = {"temperature": 0.0, "repetition_penalty": 1.0}
MAX_FRAMES = 10


@pytest.fixture(scope="module")
def conditioner(omni_dir):
    """Builds the prefill conditioning as the talker stage does (models/qwen3_omni/prompt.py)."""
    from vllm_omni_plugin.models.qwen3_omni.prompt import load_conditioner

    return load_conditioner(omni_dir)


@pytest.fixture(scope="module")
def talker_config(omni_dir):
    from transformers import Qwen3OmniMoeConfig

    return talker_hf_config(Qwen3OmniMoeConfig.from_pretrained(omni_dir))


# A frame whose reference argmax (talker head or any code-predictor head) wins by less than
# this is a near-tie on the random tiny weights: float32 summation order (batch size, threads)
# may flip it, so the exact comparisons stop before the first such frame.
NEAR_TIE = 1e-3


def _margin(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def _reference(omni_model, ids: torch.Tensor, **media):
    """(transformers' greedy output, number of leading frames without a near-tie)."""
    talker = omni_model.talker
    tcfg = omni_model.config.talker_config
    from vllm_omni_plugin.models.qwen3_omni.talker import suppressed_codec_ids

    suppressed = suppressed_codec_ids(tcfg.text_config.vocab_size, tcfg.codec_eos_token_id)
    heads: list[list[float]] = [[] for _ in range(tcfg.num_code_groups)]

    def record(group):
        def hook(_module, _args, logits):
            last = logits[0, -1]
            if group == 0:
                last = last.masked_fill(suppressed, float("-inf"))
            heads[group].append(_margin(last))

        return hook

    hooks = [talker.codec_head.register_forward_hook(record(0))]
    hooks += [
        head.register_forward_hook(record(j + 1))
        for j, head in enumerate(talker.code_predictor.lm_head)
    ]
    try:
        ref = reference_generate(
            omni_model, ids, thinker_max_new_tokens=6, max_frames=MAX_FRAMES, **media
        )
    finally:
        for h in hooks:
            h.remove()
    margins = [min(h[f] for h in heads) for f in range(ref.num_frames)]
    clear = next((f for f, m in enumerate(margins) if m < NEAR_TIE), ref.num_frames)
    return ref, clear


@pytest.fixture(scope="module")
def references(omni_model, omni_dir):
    """prompt -> (prompt ids, transformers' greedy output, number of leading frames without a
    near-tie)."""
    out = {}
    for p in PROMPTS:
        ids = chat_input_ids(omni_dir, p)
        out[p] = (ids[0].tolist(), *_reference(omni_model, ids))
    return out


def _media_reference(omni_model, omni_dir, kind: str):
    """A prompt with one media part through transformers' processor: (prompt ids, the
    thinker's hidden states at its media positions as transformers' generate reads them, the
    items' grids (images), the talker's prefill positions in transformers `[3, L]`,
    transformers' greedy output, leading frames without a near-tie)."""
    import json

    import numpy as np

    from vllm_omni_plugin.models.qwen3_omni.positions import VisualGrid

    from .thinker_states_common import chat_prompt, processor_for, random_image

    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)).astype(np.float32)
    media = {"audio": {"audio": [tone]}, "image": {"images": [random_image()]}}[kind]
    with processor_for(omni_dir) as processor:
        text = chat_prompt(processor, [{"type": "text", "text": "What is this?"}, {"type": kind}])
        inputs = processor(text=[text], return_tensors="pt", **media)
    ids = inputs.pop("input_ids")
    layer = json.loads((omni_dir / "config.json").read_text())["talker_config"][
        "accept_hidden_layer"
    ]
    with torch.no_grad():
        states = omni_model.thinker(input_ids=ids, output_hidden_states=True, **inputs)
    cfg = omni_model.config.thinker_config
    mask = torch.isin(ids[0], torch.tensor([cfg.audio_token_id, cfg.image_token_id]))
    assert int(mask.sum()) >= 4
    hidden = states.hidden_states[layer][0][mask]
    grids = [VisualGrid(*map(int, g)) for g in inputs.get("image_grid_thw", [])]
    prefill_positions = []

    def record(_module, _args, kwargs):
        if kwargs["inputs_embeds"].shape[1] > 1:
            prefill_positions.append(kwargs["position_ids"])

    hook = omni_model.talker.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        ref = _reference(omni_model, ids, **inputs)
    finally:
        hook.remove()
    # [4, 1, L] (text row, then the three M-RoPE rows): the three rows, as vLLM takes them.
    (positions,) = prefill_positions
    return ids[0].tolist(), hidden, grids, positions[1:, 0].long(), *ref


@pytest.fixture(scope="module")
def audio_reference(omni_model, omni_dir):
    return _media_reference(omni_model, omni_dir, "audio")


@pytest.fixture(scope="module")
def image_reference(omni_model, omni_dir):
    return _media_reference(omni_model, omni_dir, "image")


# The published checkpoint's generation config (the thinker's) ends text at these ids: past the
# codec vocabulary, as they are at full size.
PUBLISHED_TEXT_EOS = [151645, 151643]


@pytest.fixture(scope="module")
def engine_dir(omni_dir, tmp_path_factory):
    """The tiny checkpoint with the published generation config's EOS ids, for the engine: the
    talker must take none of them as its own (test_vllm_talker_min_tokens_masks_the_codec_eos)."""
    import json

    out = tmp_path_factory.mktemp("talker-engine-checkpoint")
    for f in omni_dir.iterdir():
        (out / f.name).symlink_to(f)
    generation = out / "generation_config.json"
    config = json.loads(generation.read_text())
    generation.unlink()
    generation.write_text(json.dumps({**config, "eos_token_id": PUBLISHED_TEXT_EOS}))
    return out


@pytest.fixture(scope="module")
def llm(engine_dir):
    from vllm import LLM

    from vllm_omni_plugin.models.qwen3_omni.predictor_probe import PREDICTOR_PROBE
    from vllm_omni_plugin.models.qwen3_omni.talker_runner import talker_engine_args

    engine = LLM(
        model=str(engine_dir),
        **talker_engine_args(),
        worker_extension_cls=PREDICTOR_PROBE,
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=4,
        # Prefills of 16-34 positions: all but the shortest prompt prefill in chunks, in steps
        # shared with other requests' chunks and decode steps. (The shortest one prefills in
        # one step: vLLM's CPU runner cannot rewind a seeded CPU generator after a chunk.)
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        seed=0,
    )
    yield engine
    shut_down(engine)


def _generate(llm, conditioner, talker_config, requests, **sampling) -> list[torch.Tensor]:
    """requests: [(prompt ids, thinker text ids[, media hidden states[, 3-D positions]])] in
    one batch -> each one's frames [G, n]."""
    from vllm_omni_plugin.models.qwen3_omni.talker_runner import (
        frame_sampling_params,
        frames_from_logprobs,
    )

    speaker = talker_config.speaker_id["ethan"]
    prompts = [
        {"prompt_embeds": conditioner.prefill(r[0], r[1][0], speaker, *r[2:3])} for r in requests
    ]
    params = [
        frame_sampling_params(talker_config, r[1], MAX_FRAMES, *r[3:4], **sampling)
        for r in requests
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    text = talker_config.text_config
    frames = []
    for out in outs:
        f = frames_from_logprobs(
            out.outputs[0].logprobs,
            text.vocab_size,
            talker_config.code_predictor_config.vocab_size,
            talker_config.num_code_groups,
        )
        assert f.shape[1] == len(out.outputs[0].token_ids)
        if f.shape[1] and int(f[0, -1]) == talker_config.codec_eos_token_id:
            f = f[:, :-1]  # the codec EOS ends the speech: no frame
        frames.append(f)
    return frames


def test_vllm_talker_frames_equal_transformers(llm, conditioner, talker_config, references):
    """vLLM's engine (paged attention, fused MoE, its sampler at temperature 0), the code
    predictor inside its step: every code group of every frame equals transformers' greedy
    `generate` on the same weights, exactly, up to the first near-tie (NEAR_TIE)."""
    ids, ref, clear = references[PROMPTS[0]]
    (frames,) = _generate(llm, conditioner, talker_config, [(ids, ref.text_ids)], **GREEDY)
    assert clear > 1
    if clear == ref.num_frames:
        assert frames.shape == ref.codes.shape
    assert torch.equal(frames[:, :clear], ref.codes[:, :clear])


def test_vllm_talker_min_tokens_masks_the_codec_eos(llm, conditioner, talker_config, references):
    """`min_tokens` (a deploy's default_sampling_params or a request's own): until then vLLM masks
    the request's stop ids, which are the codec EOS alone, not the checkpoint's text EOS ids
    (past the codec vocabulary here, as at full size: engine_dir). Every frame is written, and
    up to the first near-tie (NEAR_TIE) they equal transformers' greedy ones."""
    ids, ref, clear = references[PROMPTS[0]]
    request = [(ids, ref.text_ids)]
    (frames,) = _generate(llm, conditioner, talker_config, request, min_tokens=MAX_FRAMES, **GREEDY)
    assert frames.shape[1] == MAX_FRAMES
    assert clear > 1
    assert torch.equal(frames[:, :clear], ref.codes[:, :clear])


def test_vllm_talker_batched_equals_alone(llm, conditioner, talker_config, references):
    """Three requests of different prompt and text lengths in one engine step each: each one's
    frames equal transformers' for it alone, up to its first near-tie (NEAR_TIE)."""
    requests = [(ids, ref.text_ids) for ids, ref, _ in references.values()]
    got = _generate(llm, conditioner, talker_config, requests, **GREEDY)
    for frames, (prompt, (_, ref, clear)) in zip(got, references.items(), strict=True):
        assert clear > 1, prompt
        assert torch.equal(frames[:, :clear], ref.codes[:, :clear]), prompt


def test_vllm_talker_seeded_sampling(llm, conditioner, talker_config, references):
    """The checkpoint's sampling (talker top-k 50, temperature 0.9, repetition penalty 1.05;
    code predictor top-k 50, top-p 0.8): the same seed gives the same frames, another seed
    other frames."""
    ids, ref, _ = references[PROMPTS[2]]

    def run(seed: int) -> torch.Tensor:
        (frames,) = _generate(llm, conditioner, talker_config, [(ids, ref.text_ids)], seed=seed)
        return frames

    first = run(7)
    assert first.shape[1] > 1
    assert torch.equal(run(7), first)
    assert not torch.equal(run(8), first)


def test_vllm_talker_penalty_ignores_earlier_requests(llm, conditioner, talker_config, references):
    """Greedy with repetition penalty 2.0 (so that a miscounted id changes the frames): a
    request gives the same frames after another request, with a shorter prompt, wrote its
    codes into the engine's batch row (where the first one's prompt positions lie)."""
    long_ids, long_ref, _ = references[PROMPTS[1]]
    short_ids, short_ref, _ = references[PROMPTS[2]]
    settings = {"temperature": 0.0, "repetition_penalty": 2.0}

    def run(ids, text) -> torch.Tensor:
        (frames,) = _generate(llm, conditioner, talker_config, [(ids, text)], **settings)
        return frames

    first = run(long_ids, long_ref.text_ids)
    run(short_ids, short_ref.text_ids)
    assert first.shape[1] > 1
    assert torch.equal(run(long_ids, long_ref.text_ids), first)


def test_vllm_talker_audio_prompt_frames_equal_transformers(
    llm, conditioner, talker_config, audio_reference, references
):
    """An audio prompt: the prefill reads the thinker's hidden states at the audio positions
    (`hidden_projection`) and text embeddings elsewhere, as transformers' generate builds it
    (whose talker runs 1-D positions for audio prompts, as vLLM's does here): every frame
    equals transformers' exactly up to the first near-tie (NEAR_TIE). Batched with two text
    prompts, each gives what it gives alone."""
    ids, hidden, _, positions, ref, clear = audio_reference
    torch.testing.assert_close(positions, torch.arange(positions.shape[1]).expand(3, -1))
    assert clear > 1
    (alone,) = _generate(llm, conditioner, talker_config, [(ids, ref.text_ids, hidden)], **GREEDY)
    if clear == ref.num_frames:
        assert alone.shape == ref.codes.shape
    assert torch.equal(alone[:, :clear], ref.codes[:, :clear])
    # The states matter: zeros in their place speak otherwise.
    (other,) = _generate(
        llm, conditioner, talker_config, [(ids, ref.text_ids, torch.zeros_like(hidden))], **GREEDY
    )
    assert not torch.equal(other[:, :clear], alone[:, :clear])
    texts = [references[p] for p in PROMPTS[:2]]
    requests = [(i, r.text_ids) for i, r, _ in texts]
    got = _generate(
        llm, conditioner, talker_config, [*requests, (ids, ref.text_ids, hidden)], **GREEDY
    )
    assert torch.equal(got[-1][:, :clear], ref.codes[:, :clear])
    for frames, (_, text_ref, text_clear) in zip(got[:2], texts, strict=True):
        assert torch.equal(frames[:, :text_clear], text_ref.codes[:, :text_clear])


def test_vllm_talker_image_prompt_frames_equal_transformers(
    llm, conditioner, talker_config, image_reference, references
):
    """An image prompt: the prefill reads the thinker's states at the image positions, and the
    talker runs transformers' 3-D positions (the image's merged patch grid, the text after it
    one past the grid's largest; positions.py), computed from the prompt's grid equal to those
    transformers' talker ran: every frame equals transformers' exactly up to the first near-tie
    (NEAR_TIE). Batched with a text prompt (1-D positions), each gives what it gives alone."""
    ids, hidden, grids, want, ref, clear = image_reference
    assert clear >= 1
    positions = conditioner.positions(ids, grids)
    torch.testing.assert_close(positions[0], want, atol=0, rtol=0)
    assert positions[1] == int(want.max()) + 1 - want.shape[1] < 0
    request = (ids, ref.text_ids, hidden, positions)
    (alone,) = _generate(llm, conditioner, talker_config, [request], **GREEDY)
    if clear == ref.num_frames:
        assert alone.shape == ref.codes.shape
    assert torch.equal(alone[:, :clear], ref.codes[:, :clear])
    text_ids, text_ref, text_clear = references[PROMPTS[0]]
    pair = [(text_ids, text_ref.text_ids), request]
    got = _generate(llm, conditioner, talker_config, pair, **GREEDY)
    assert torch.equal(got[0][:, :text_clear], text_ref.codes[:, :text_clear])
    assert torch.equal(got[1][:, :clear], ref.codes[:, :clear])


def test_compiled_predictor_layers_equal_their_torch_ops(llm):
    """The code predictor's layers through torch.compile (inductor, dynamic batch and sequence
    dimensions: what the talker's CUDA graphs hold on a GPU) against the same layers op by op,
    float32: hidden states within 1e-4, and a frame's greedy codes equal, at batch 1 and 3."""
    (rows,) = llm.collective_rpc("compare_compiled_layers", args=([1, 3], 0, "inductor"))
    assert [r["rows"] for r in rows] == [1, 3]
    for row in rows:
        assert row["hidden_max_abs_diff"] < 1e-4, row
        assert row["greedy_codes_equal"], row


def test_talker_stage_warm_up_requests_run_on_the_engine(llm, conditioner, talker_config):
    """The talker stage's warm-up requests (stages/engine_warmup.py runs them on CUDA): prompt
    embeddings of the asked length with the text given whole, sampled as the stage samples
    (a stage `min_tokens` does not hold them), each ends after at most two frames."""
    from types import SimpleNamespace

    from vllm_omni_plugin.stages.qwen3_omni import TalkerStage

    stage = SimpleNamespace(
        conditioner=conditioner,
        talker_config=talker_config,
        sampling={"temperature": 0.9, "top_k": 50, "min_tokens": 128},
    )
    requests = [TalkerStage._warmup_request(stage, n, f"warm-{n}") for n in (3, 17, 40)]
    assert [r[0]["prompt_embeds"].shape[0] for r in requests] == [3, 17, 40]
    outs = llm.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False)
    for out in outs:
        assert out.finished and 1 <= len(out.outputs[0].token_ids) <= 2
