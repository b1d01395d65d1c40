"""The talker as vLLM's model (models/qwen3_omni/talker.py) stepped by vLLM's own engine, and the
memory-bandwidth floor of its decode step. bench_talker_step.py runs it.

Each batch size B: B requests submitted at once, each running a fixed number of frames (the
codec end code is masked until then: `min_tokens`), greedy and with the checkpoint's sampling.
`LLMEngine.step()` is called here, one call per engine-core step; the time between the returns
of consecutive steps after the first (the prefill of every request) is a decode step.

The floor of a decode step is the bytes of weights it must read once, over the device's HBM
bandwidth (H200: 4.8 TB/s, H100 SXM: 3.35 TB/s). Counted from the checkpoint's own tensors
(`step_weight_bytes`), at the run's dtype:
- once per step: the talker's attention, norms, router, shared expert, codec head, and the text
  projection (each request's text entry);
- once per code-predictor sub-step (num_code_groups - 1 of them, each a pass through all its
  layers and its final norm): the code predictor's layers; its heads once each (sub-step j reads
  head j only);
- the routed experts a batch touches: E experts, top-k per token, routing taken as uniform, so
  E * (1 - (1 - k/E)^B) distinct experts per layer in expectation;
- rows of the embedding tables: per request, one of the codec embedding, one of each of the code
  predictor's tables and one of the thinker's token embedding;
- nothing of `hidden_projection` (prefill only), Code2Wav or the rest of the thinker.
The KV cache a step reads (each request's context, every layer) is reported beside it.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HBM_BYTES_PER_S = 4.8e12  # H200
# Datasheet memory bandwidth by the name torch gives the device; others are floored as an H200.
HBM_BYTES_PER_S_BY_DEVICE = {"H100 80GB HBM3": 3.35e12, "H200": 4.8e12}
FRAME_S = 0.08
PROMPTS_FILE = "talker_prompts.pt"
PROMPT_TEXTS = [f"Tell me story number {i}." for i in range(8)]
THINKER_IDS = 64  # generated thinker ids each request carries (its text entries)
SAMPLINGS = {"greedy": {"temperature": 0.0}, "checkpoint": {}}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def hbm_bytes_per_s(device_name: str) -> float:
    for key, value in HBM_BYTES_PER_S_BY_DEVICE.items():
        if key in device_name:
            return value
    return HBM_BYTES_PER_S


def expected_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts B tokens route to, each picking top_k of num_experts uniformly."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, read from the safetensors headers (nothing loaded)."""
    from safetensors import safe_open

    shapes = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass
class StepWeights:
    """Elements of the checkpoint a decode step reads, by how often (module docstring)."""

    per_step: int  # read once a step
    per_substep: int  # the code predictor's layers and norm, read each sub-step
    substeps: int  # num_code_groups - 1
    predictor_heads: int  # one head per sub-step: all of them once
    expert: int  # one routed expert of one layer
    moe_layers: int
    num_experts: int
    top_k: int
    row_per_request: int  # embedding-table rows a request reads

    def elements(self, batch: int) -> dict[str, float]:
        experts = expected_experts(self.num_experts, self.top_k, batch)
        out = {
            "dense": self.per_step,
            "code_predictor": self.per_substep * self.substeps + self.predictor_heads,
            "routed_experts": self.expert * self.moe_layers * experts,
            "embedding_rows": self.row_per_request * batch,
        }
        out["total"] = sum(out.values())
        out["expected_experts_per_layer"] = experts
        return out


def step_weights(shapes: dict[str, tuple[int, ...]], talker_config) -> StepWeights:
    """Classify the checkpoint's tensors (`talker.*` and the thinker's token embedding)."""
    text = talker_config.text_config
    per_step = per_substep = heads = experts = rows = 0
    layers = set()
    for name, shape in shapes.items():
        if name == "thinker.model.embed_tokens.weight":
            rows += shape[1]
        if not name.startswith("talker."):
            continue  # Code2Wav and the rest of the thinker: other stages
        key = name[len("talker.") :]
        if key.startswith("model.layers.") and ".mlp.experts." in key:
            experts += _numel(shape)
            layers.add(key.split(".")[2])
        elif key == "model.codec_embedding.weight" or key.startswith(
            "code_predictor.model.codec_embedding."
        ):
            rows += shape[1]
        elif key.startswith("code_predictor.lm_head."):
            heads += _numel(shape)
        elif key.startswith("code_predictor."):
            per_substep += _numel(shape)
        elif key.startswith("hidden_projection."):
            continue  # projects the thinker's hidden states of the prompt: prefill only
        else:
            per_step += _numel(shape)
    if not layers or experts % (len(layers) * text.num_experts):
        raise ValueError("no routed experts, or a layer without all of them, in the checkpoint")
    return StepWeights(
        per_step=per_step,
        per_substep=per_substep,
        substeps=talker_config.num_code_groups - 1,
        predictor_heads=heads,
        expert=experts // (len(layers) * text.num_experts),
        moe_layers=len(layers),
        num_experts=text.num_experts,
        top_k=text.num_experts_per_tok,
        row_per_request=rows,
    )


def kv_elements(talker_config, batch: int, context: float) -> float:
    """KV-cache elements a decode step reads: each request's `context` positions, all layers."""
    text = talker_config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_position = 2 * text.num_key_value_heads * head_dim * text.num_hidden_layers
    return per_position * context * batch


def floor_row(
    weights: StepWeights,
    talker_config,
    batch: int,
    context: float,
    elt: int,
    bytes_per_s: float = HBM_BYTES_PER_S,
) -> dict:
    """The floor of one decode step at `batch`: bytes by part, seconds at `bytes_per_s`."""
    parts = weights.elements(batch)
    experts = parts.pop("expected_experts_per_layer")
    weight_bytes = {k: round(v * elt) for k, v in parts.items()}
    kv = round(kv_elements(talker_config, batch, context) * elt)
    return {
        "weight_bytes": weight_bytes,
        "expected_experts_per_layer": round(experts, 3),
        "floor_ms": _ms(weight_bytes["total"] / bytes_per_s),
        "kv_bytes": kv,
        "floor_with_kv_ms": _ms((weight_bytes["total"] + kv) / bytes_per_s),
    }


def _ms(seconds: float) -> float:
    return float(f"{seconds * 1000:.5g}")


def write_prompts(work: Path, conditioner) -> None:
    """Each prompt's prefill embeddings, conditioned as the talker stage does (a
    TalkerConditioner, models/qwen3_omni/prompt.py), and the thinker ids its text entries come
    from, into `work/PROMPTS_FILE`."""
    from vllm_omni_plugin.testing.qwen3_omni_reference import chat_input_ids

    config = conditioner.config
    speaker = config.talker_config.speaker_id["ethan"]
    vocab = config.thinker_config.text_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = []
    with torch.inference_mode():
        for text in PROMPT_TEXTS:
            ids = chat_input_ids(work, text)[0].tolist()
            thinker = torch.randint(0, min(vocab, 151000), (THINKER_IDS,), generator=gen)
            embeds = conditioner.prefill(ids, int(thinker[0]), speaker)
            prompts.append({"embeds": embeds.float().cpu(), "text_ids": thinker.tolist()})
    torch.save(prompts, work / PROMPTS_FILE)


def load_prompts(model_dir: Path) -> list[dict]:
    path = model_dir / PROMPTS_FILE
    if not path.exists():  # a checkpoint built elsewhere: condition on the CPU
        from vllm_omni_plugin.models.qwen3_omni.prompt import load_conditioner

        write_prompts(model_dir, load_conditioner(model_dir))
    return torch.load(path)


def make_llm(model_dir: Path, device: str, eager: bool, max_num_seqs: int, max_model_len: int):
    from vllm import LLM

    from vllm_omni_plugin.models.qwen3_omni.talker_runner import talker_engine_args

    kwargs = {}
    if device == "cuda":
        kwargs["gpu_memory_utilization"] = 0.9  # the GPU holds nothing else
    return LLM(
        model=str(model_dir),
        **talker_engine_args(),
        enforce_eager=eager,
        dtype=dtype_name(device),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        seed=0,
        **kwargs,
    )


def dtype_name(device: str) -> str:
    # vLLM's CPU build runs the tiny float32 checkpoint as saved; on the GPU bf16.
    return "bfloat16" if device == "cuda" else "float32"


def time_batch(
    llm, talker_config, prompts: list[dict], batch: int, frames: int, sampling: str, dtype
) -> dict:
    """B requests at once, `frames` frames each; per engine-core step, its wall time and the
    frames it produced."""
    from vllm_omni_plugin.models.qwen3_omni.talker_runner import frame_sampling_params

    engine = llm.llm_engine
    settings = {**SAMPLINGS[sampling], "ignore_eos": True, "min_tokens": frames}
    if sampling != "greedy":
        settings["seed"] = batch
    lengths = []
    for i in range(batch):
        p = prompts[i % len(prompts)]
        params = frame_sampling_params(talker_config, p["text_ids"], frames, **settings)
        engine.add_request(
            f"{sampling}-{batch}-{i}", {"prompt_embeds": p["embeds"].to(dtype)}, params
        )
        lengths.append(p["embeds"].shape[0])
    # A step is timed (from the previous step's return to its own) when every request of the
    # batch was decoding in it: requests reach the running engine one by one, so the first ones
    # may prefill (and finish) a step or two before the last ones.
    made: dict[str, int] = {}
    prefill_ms, decode = None, []
    steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        if not outs:
            continue
        now = time.perf_counter()
        steps += 1
        running = len(made) == batch and all(made.values())
        if prefill_ms is None:
            prefill_ms = (now - t0) * 1000
        elif running and len(outs) == batch:
            decode.append(now - t0)
        t0 = now
        for out in outs:
            made[out.request_id] = len(out.outputs[0].token_ids)
    if not decode:
        raise RuntimeError(f"batch {batch}: no step with every request decoding; more --frames")
    step_ms = statistics.median(decode) * 1000
    return {
        "sampling": sampling,
        "batch": batch,
        "frames": frames,
        "frames_made": sorted(set(made.values())),
        "steps": steps,
        "decode_steps_timed": len(decode),
        "first_step_ms": round(prefill_ms, 2),
        "step_ms": round(step_ms, 3),
        "step_ms_p90": round(sorted(decode)[int(0.9 * (len(decode) - 1))] * 1000, 3),
        "mean_prompt_len": statistics.mean(lengths),
        "rtf": round(step_ms / 1000 / FRAME_S, 4),
        "audio_s_per_wall_s": round(batch * FRAME_S / (step_ms / 1000), 2),
    }


def _merged_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def profile_batch(
    llm, talker_config, prompts: list[dict], batch: int, steps: int, dtype, device: str
) -> dict:
    """`batch` greedy requests; once every one decodes, `steps` engine steps under torch's
    profiler (the engine must run in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0). Per step:
    the wall time, the device time its kernels took (summed, and their union: the time the GPU
    was busy) and the kernels launched; the top ops by device time (by CPU time without a GPU).
    A wall time far above the busy time: the step waits on the host, not on the GPU's work."""
    from torch.profiler import ProfilerActivity, profile

    from vllm_omni_plugin.models.qwen3_omni.talker_runner import frame_sampling_params

    engine = llm.llm_engine
    frames = steps + 8
    for i in range(batch):
        p = prompts[i % len(prompts)]
        params = frame_sampling_params(
            talker_config,
            p["text_ids"],
            frames,
            temperature=0.0,
            ignore_eos=True,
            min_tokens=frames,
        )
        engine.add_request(f"profile-{i}", {"prompt_embeds": p["embeds"].to(dtype)}, params)
    made: dict[str, int] = {}
    while len(made) < batch or not all(made.values()):
        for out in engine.step():
            made[out.request_id] = len(out.outputs[0].token_ids)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    walls = []
    with profile(activities=activities) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    sort_by = "self_device_time_total" if kernels else "self_cpu_time_total"
    return {
        "batch": batch,
        "steps": steps,
        "step_wall_ms": round(statistics.median(walls) * 1000, 3),
        "kernel_ms_per_step": round(sum(b - a for a, b in spans) / 1000 / steps, 3),
        "gpu_busy_ms_per_step": round(_merged_us(spans) / 1000 / steps, 3),
        "kernels_per_step": round(len(kernels) / steps, 1),
        "top_ops": prof.key_averages().table(sort_by=sort_by, row_limit=40),
    }


def run(
    model_dir: Path,
    device: str,
    batches: list[int],
    frames: int,
    samplings: list[str],
    eager: bool,
    report: dict,
    save=lambda: None,
    profile: int | None = None,
) -> None:
    """Time every (sampling, batch), put each beside its floor, into `report` (`save()` after
    each row); then, with `profile` (a batch size), where a step's time goes (`profile_batch`)."""
    import vllm
    from transformers import Qwen3OmniMoeConfig

    from vllm_omni_plugin.families.qwen3_omni import talker_hf_config

    talker_config = talker_hf_config(Qwen3OmniMoeConfig.from_pretrained(model_dir))
    elt = _DTYPES[dtype_name(device)].itemsize
    weights = step_weights(checkpoint_shapes(model_dir), talker_config)
    prompts = load_prompts(model_dir)
    longest = max(p["embeds"].shape[0] for p in prompts)
    t0 = time.perf_counter()
    llm = make_llm(model_dir, device, eager, max(32, *batches), longest + frames + 16)
    report.update(
        {
            "engine": "vllm",
            "vllm": vllm.__version__,
            "dtype": dtype_name(device),
            "cuda_graphs": not eager and device == "cuda",
            # The code predictor's layers run compiled inside its graphs (files without this
            # key predate that: uncompiled).
            "predictor_compiled": not eager and device == "cuda",
            "load_s": round(time.perf_counter() - t0, 2),
            "hbm_bytes_per_s": hbm_bytes_per_s(report["device"]),
            "step_weights": weights.__dict__,
            "talker_vllm": [],
        }
    )
    save()
    dtype = _DTYPES[report["dtype"]]
    time_batch(llm, talker_config, prompts, min(batches), min(frames, 4), samplings[0], dtype)
    for sampling in samplings:
        for b in batches:
            row = time_batch(llm, talker_config, prompts, b, frames, sampling, dtype)
            # Decode steps read contexts from prompt+1 to prompt+frames positions: the mean.
            context = row["mean_prompt_len"] + (frames + 1) / 2
            row.update(
                floor_row(weights, talker_config, b, context, elt, report["hbm_bytes_per_s"])
            )
            row["step_over_floor"] = float(f"{row['step_ms'] / row['floor_ms']:.4g}")
            print(json.dumps(row), flush=True)
            report["talker_vllm"].append(row)
            save()
    if profile:
        report["profile"] = profile_batch(llm, talker_config, prompts, profile, 20, dtype, device)
        print(report["profile"]["top_ops"])
        print(json.dumps({k: v for k, v in report["profile"].items() if k != "top_ops"}))
        save()
    del llm
