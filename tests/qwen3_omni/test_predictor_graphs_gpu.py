"""The talker engine's code predictor as CUDA graphs (models/qwen3_omni/predictor_graphs.py)
against its eager path, on a GPU: the same codes from the same inputs and noise, and the same
frames out of vLLM's engine. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from vllm_engines import shut_down

from .test_talker_vllm import _generate, conditioner, talker_config  # noqa: F401

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

PROMPT_TEXT = "Say hello."


@pytest.fixture(scope="module")
def graphed_llm(omni_dir):
    from vllm import LLM

    from vllm_omni_plugin.models.qwen3_omni.predictor_probe import PREDICTOR_PROBE
    from vllm_omni_plugin.models.qwen3_omni.talker_runner import talker_engine_args

    engine = LLM(
        model=str(omni_dir),
        **talker_engine_args(),
        worker_extension_cls=PREDICTOR_PROBE,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        gpu_memory_utilization=0.3,
        seed=0,
    )
    yield engine
    shut_down(engine)


@pytest.fixture(scope="module")
def request_ids(omni_dir):
    from transformers import AutoTokenizer

    from vllm_omni_plugin.testing.qwen3_omni_reference import chat_input_ids

    tok = AutoTokenizer.from_pretrained(omni_dir)
    text = tok.encode("Hello there, how are you today?", add_special_tokens=False)
    return chat_input_ids(omni_dir, PROMPT_TEXT)[0].tolist(), text


def test_predictor_graphs_give_the_eager_codes(graphed_llm):
    """Batch sizes on a bucket (1, 2, 8) and between (3, 5): greedy rows and mixed rows
    (greedy, seeded, global draws) give exactly the eager path's codes; a batch between
    buckets the eager path's over its bucket (a replay's shapes: the GPU's matrix kernels
    may round differently for another number of rows)."""
    assert graphed_llm.collective_rpc("predictor_graphed") == [True]
    (rows,) = graphed_llm.collective_rpc("compare_predictor_paths", args=([1, 2, 3, 5, 8], 0))
    for row in rows:
        on_bucket = row["rows"] == row["bucket"]
        checked = [k for k in row if k.endswith("_equal") and (on_bucket or "padded" in k)]
        assert len(checked) == 2 and all(row[k] for k in checked), row


def test_engine_frames_with_graphs_equal_eager(
    graphed_llm,
    conditioner,  # noqa: F811
    talker_config,  # noqa: F811
    request_ids,
):
    """One request (bucket 1: the replay's shapes are the eager path's), greedy and seeded:
    the same frames with the predictor's graphs as with its eager path."""
    requests = [request_ids]

    def frames(graphs: bool, **sampling) -> torch.Tensor:
        graphed_llm.collective_rpc("use_predictor_graphs", args=(graphs,))
        try:
            (out,) = _generate(graphed_llm, conditioner, talker_config, requests, **sampling)
        finally:
            graphed_llm.collective_rpc("use_predictor_graphs", args=(True,))
        return out

    greedy = {"temperature": 0.0}
    graphed = frames(True, **greedy)
    assert graphed.shape[1] > 1
    assert torch.equal(graphed, frames(False, **greedy))
    seeded = frames(True, seed=7)
    assert torch.equal(seeded, frames(False, seed=7))
    assert torch.equal(seeded, frames(True, seed=7))
