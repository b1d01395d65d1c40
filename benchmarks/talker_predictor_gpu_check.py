"""The talker engine's code predictor on a GPU: its CUDA graphs against its eager path, and the
time of the predictor alone per talker step. Prints one JSON object.

    python3 benchmarks/talker_predictor_gpu_check.py [--model DIR] [--dtype bfloat16] [--out FILE]

Without `--model` it builds the tiny Qwen3-Omni checkpoint in a temporary folder. It starts
vLLM's talker engine (as tests/qwen3_omni/test_talker_vllm.py does) with CUDA graphs, and
reports from inside its worker (models/qwen3_omni/predictor_probe.py):

- `paths`: per batch size, whether the graphs' codes equal the eager path's (greedy rows, and
  mixed greedy / seeded / global rows), also over the padded bucket for sizes between buckets;
- `compiled_layers`: per batch size, the predictor's compiled layers against their torch ops
  (largest hidden-state difference, greedy codes equal: informative in bf16, where near-equal
  logits of random weights may flip);
- `frames`: the engine's frames for one request and for four, greedy, with the predictor's
  graphs and with its eager path (`equal`), and seeded (the same seed twice, graphs vs eager,
  another seed differs);
- `predictor_ms`: milliseconds per talker step of the predictor alone (all sub-steps and the
  sampling, every row sampled) at batch 1, 8 and 32, eager and graphed;
- `eager_engine`: an `enforce_eager` engine's (unless `--no-eager-engine`): its predictor is not
  graphed, and whether its greedy frames equal the graphed engine's (vLLM's own graphs and
  compilation may round differently: informative, not a pass/fail).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

PROMPTS = ["Say hello.", "What is two plus two?", "Hi", "Count to three."]
TEXT = "Hello there, how are you today? I am fine, thank you."
MAX_FRAMES = 24


def engine(model_dir: Path, dtype: str, eager: bool):
    from vllm import LLM

    from vllm_omni_plugin.models.qwen3_omni.predictor_probe import PREDICTOR_PROBE
    from vllm_omni_plugin.models.qwen3_omni.talker_runner import talker_engine_args

    return LLM(
        model=str(model_dir),
        **talker_engine_args(),
        worker_extension_cls=PREDICTOR_PROBE,
        enforce_eager=eager,
        dtype=dtype,
        max_model_len=1024,
        max_num_seqs=32,
        gpu_memory_utilization=0.3,
        seed=0,
    )


class Requests:
    """The talker's prefill conditioning and sampling settings, as the talker stage builds them."""

    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer, Qwen3OmniMoeConfig

        from vllm_omni_plugin.families.qwen3_omni import talker_hf_config
        from vllm_omni_plugin.models.qwen3_omni.prompt import load_conditioner
        from vllm_omni_plugin.testing.qwen3_omni_reference import chat_input_ids

        self.conditioner = load_conditioner(model_dir)
        self.config = talker_hf_config(Qwen3OmniMoeConfig.from_pretrained(model_dir))
        tok = AutoTokenizer.from_pretrained(model_dir)
        self.text = tok.encode(TEXT, add_special_tokens=False)
        self.prompts = [chat_input_ids(model_dir, p)[0].tolist() for p in PROMPTS]

    def frames(self, llm, count: int, **sampling) -> list[list[list[int]]]:
        from vllm_omni_plugin.models.qwen3_omni.talker_runner import (
            frame_sampling_params,
            frames_from_logprobs,
        )

        speaker = self.config.speaker_id["ethan"]
        prompts = [
            {"prompt_embeds": self.conditioner.prefill(ids, self.text[0], speaker)}
            for ids in self.prompts[:count]
        ]
        params = frame_sampling_params(self.config, self.text, MAX_FRAMES, **sampling)
        outs = llm.generate(prompts, [params] * count, use_tqdm=False)
        return [
            frames_from_logprobs(
                out.outputs[0].logprobs,
                self.config.text_config.vocab_size,
                self.config.code_predictor_config.vocab_size,
                self.config.num_code_groups,
            ).tolist()
            for out in outs
        ]


def predictor_frames(llm, requests: Requests, graphs: bool, count: int, **sampling):
    llm.collective_rpc("use_predictor_graphs", args=(graphs,))
    try:
        return requests.frames(llm, count, **sampling)
    finally:
        llm.collective_rpc("use_predictor_graphs", args=(True,))


def check(model_dir: Path, dtype: str, eager_engine: bool) -> dict:
    requests = Requests(model_dir)
    import vllm

    cuda = torch.cuda.is_available()
    report: dict = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "dtype": dtype,
        "vllm": vllm.__version__,
    }
    start = time.perf_counter()
    # Off CUDA (a dry run of this script) the predictor has no graphs: both paths are eager.
    llm = engine(model_dir, dtype, eager=not cuda)
    report["graphed_engine_start_s"] = round(time.perf_counter() - start, 1)
    (report["predictor_graphed"],) = llm.collective_rpc("predictor_graphed")
    (report["paths"],) = llm.collective_rpc("compare_predictor_paths", args=([1, 3, 8, 32], 0))
    # Compiled layers against their torch ops (on CUDA the graphs hold the compiled ones).
    (report["compiled_layers"],) = llm.collective_rpc(
        "compare_compiled_layers", args=([1, 8, 32], 0, "inductor")
    )
    frames = {}
    for count in (1, 4):
        greedy = [predictor_frames(llm, requests, g, count, temperature=0.0) for g in (1, 0)]
        seeded = [predictor_frames(llm, requests, g, count, seed=7) for g in (1, 0, 1)]
        other = predictor_frames(llm, requests, True, count, seed=8)
        frames[f"batch_{count}"] = {
            "greedy_equal": greedy[0] == greedy[1],
            "seeded_graphs_equal_eager": seeded[0] == seeded[1],
            "seeded_reproducible": seeded[0] == seeded[2],
            "other_seed_differs": other != seeded[0],
            "frames": len(greedy[0][0][0]),
        }
    report["frames"] = frames
    (report["predictor_ms"],) = llm.collective_rpc(
        "time_predictor", args=([1, 8, 32], 50 if cuda else 3)
    )
    graphed_greedy = requests.frames(llm, 4, temperature=0.0)
    del llm
    gc.collect()
    if eager_engine and cuda:
        start = time.perf_counter()
        llm = engine(model_dir, dtype, eager=True)
        report["eager_engine"] = {
            "start_s": round(time.perf_counter() - start, 1),
            "predictor_graphed": llm.collective_rpc("predictor_graphed")[0],
            "greedy_frames_equal_graphed_engine": requests.frames(llm, 4, temperature=0.0)
            == graphed_greedy,
        }
        del llm
        gc.collect()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Qwen3-Omni checkpoint (default: the tiny one, built)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--no-eager-engine", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model_dir = Path(args.model)
        else:
            from vllm_omni_plugin.testing.tiny_models import build_tiny_model

            model_dir = build_tiny_model("qwen3-omni", Path(tmp) / "qwen3-omni", seed=0)
        report = check(model_dir, args.dtype, not args.no_eager_engine)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
