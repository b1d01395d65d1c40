"""Frozen pipeline topologies: which stages exist, what each is, what feeds it, what it emits.

A topology is code, not YAML: a deploy file tunes stages but never rewires them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

StageKind = Literal["ar", "diffusion", "talker", "code2wav"]
"""What a stage runs, and so which settings its deploy entry may set (config/stage_keys.py):
"ar": vLLM's engine generating tokens; "diffusion": our diffusion engine; "talker": vLLM's
engine writing Qwen3-Omni's codec frames; "code2wav": the Code2Wav engine (frames -> audio)."""


@dataclass(frozen=True)
class StageSpec:
    """One stage of a frozen pipeline."""

    stage_id: int
    """Position of the stage in the pipeline; deploy YAMLs key their stages by it."""
    name: str
    """Short role name ("ar", "dit"), used in logs and process titles."""
    kind: StageKind
    """What the stage runs (see StageKind); a deploy file's `kind:` must match it."""
    inputs: list[int] = field(default_factory=list)
    """Stage ids whose outputs this stage consumes; empty for an entry stage."""
    emits: str = "image"
    """What the stage hands on: "token_ids", "image", "hidden_states", ..."""
    final_output: bool = False
    """Whether this stage's output is the pipeline's response."""
    model_subdir: str | None = None
    """Folder of the pipeline checkpoint holding this stage's model (None: the root)."""
    tokenizer_subdir: str | None = None
    """Folder holding this stage's tokenizer (AR stages; None: the model folder)."""
    pipeline_class: str | None = None
    """diffusers pipeline class a diffusion stage runs (None: read from model_index.json)."""
    hf_architecture: str | None = None
    """vLLM model architecture of an AR stage."""
    logits_processors: tuple[str, ...] = ()
    """vLLM logits processors ("module:Class") an AR stage's engine is built with. They go in
    that engine's `logits_processors` argument, never in vLLM's `vllm.logits_processors`
    entry-point group: the group's mere presence turns off vLLM 0.26-0.30's model runner V2 in
    every engine on the machine, ours or not."""
    stream_output: bool = False
    """The stage emits each request's output as ordered chunks (stages/streams.py): its edge
    to the next stage streams (that stage starts on the first chunk), and a final stage's
    chunks reach the API server as they come (Orchestrator.stream)."""
    stream_window: int = 4
    """Chunks of one request the stage may have out that the consumer has not finished with
    (back-pressure: the stage waits beyond it). Only with `stream_output`."""
    runner: str | None = None
    """The stage process's loop when not its kind's (a stages.loop.StageLoop subclass):
    "module:Class" of one outside the package (a third-party pipeline's), which the stage
    process imports; None: the loop of the stage's kind (stages/loops.py)."""
    settings: tuple[str, ...] | None = None
    """With a `runner` that is not its kind's engine: the deploy keys it reads (dotted for
    nested ones, "key=value" where only that value works); loading refuses any other key a
    deploy file or override sets on the stage, naming it. None: every key of its kind."""


@dataclass(frozen=True)
class PipelineTopology:
    """A named, frozen stage graph plus the model identifiers that select it."""

    key: str
    """Registry key, e.g. "glm_image"; deploy YAMLs may name it as `pipeline:`."""
    stages: tuple[StageSpec, ...]
    """The stages, in stage-id order."""
    diffusers_class_names: tuple[str, ...] = ()
    """model_index.json `_class_name` values that select this pipeline."""
    hf_model_types: tuple[str, ...] = ()
    """config.json `model_type` values that select this pipeline."""
    hf_architectures: tuple[str, ...] = ()
    """Model class names (legacy `model_arch`, config.json `architectures`) that select it."""
    size_granularity: int = 8
    """Image height and width must be multiples of this."""
    max_input_images: int = 0
    """Source images one request may carry (POST /v1/images/edits); 0: text-to-image only, so
    the edits route answers 400 before any stage is touched."""
    requires_input_image: bool = False
    """Every request must carry a source image (edit-only pipelines, e.g. Qwen-Image-Edit)."""
    accepts_mask: bool = False
    """Whether an edit may carry a `mask` (inpainting); otherwise a mask is a 400."""
    max_input_aspect_ratio: float | None = None
    """Longest over shortest side a source image may have (a 400 otherwise); None: no bound."""
    min_input_side: int | None = None
    """Pixels a source image's shorter side must have at least (a 400 otherwise); None: any."""
    chat_stage: int | None = None
    """The stage that answers /v1/chat/completions and /v1/completions as `vllm serve` of its
    model alone would (a vLLM text generator, e.g. Qwen3-Omni's thinker); None: no text routes."""
    audio_output: bool = False
    """Whether a chat request may ask for speech (`modalities: ["text", "audio"]`): the whole
    pipeline runs and the last stage's waveform is the answer's audio."""
    speech_prompt_limit: Callable[[list[Any]], int] | None = None
    """The resolved stages -> the most prompt ids a speech request may have (a 400 above it,
    before any stage runs; below 1 is refused at load); None: the chat stage's bound only."""
    description: str = ""

    def stage(self, stage_id: int) -> StageSpec:
        for spec in self.stages:
            if spec.stage_id == stage_id:
                return spec
        raise KeyError(f"pipeline {self.key!r} has no stage {stage_id}")

    @property
    def stage_ids(self) -> list[int]:
        return [s.stage_id for s in self.stages]

    @property
    def edges(self) -> list[tuple[int, int]]:
        return [(src, s.stage_id) for s in self.stages for src in s.inputs]

    def streams(self, from_stage: int, to_stage: int) -> bool:
        """Whether the edge streams: the producer emits chunks the consumer reads as they
        come (see StageSpec.stream_output)."""
        return (from_stage, to_stage) in self.edges and self.stage(from_stage).stream_output

    def validate(self) -> list[str]:
        """Problems with the graph itself (empty when sound)."""
        problems = validate_graph(
            {s.stage_id: list(s.inputs) for s in self.stages},
            finals=[s.stage_id for s in self.stages if s.final_output],
            duplicates=_duplicates([s.stage_id for s in self.stages]),
        )
        for s in self.stages:
            if s.stream_output and s.stream_window < 1:
                problems.append(f"stage {s.stage_id}: stream_window must be at least 1")
            module, colon, name = (s.runner or "").partition(":")
            if s.runner is not None and not (colon and module and name and ":" not in name):
                problems.append(f"stage {s.stage_id}: runner {s.runner!r} is not 'module:Class'")
        if self.chat_stage is not None:
            chat = [s for s in self.stages if s.stage_id == self.chat_stage]
            if not chat or chat[0].kind != "ar" or chat[0].inputs:
                problems.append(
                    f"chat_stage {self.chat_stage} must be an entry stage of kind 'ar' (a vLLM "
                    "text generator)"
                )
        if self.audio_output and self.chat_stage is None:
            problems.append("audio_output needs a chat_stage (speech answers a chat request)")
        return problems


def _duplicates(ids: list[int]) -> list[int]:
    seen: set[int] = set()
    return sorted({i for i in ids if i in seen or seen.add(i)})


def validate_graph(
    inputs: dict[int, list[int]], finals: list[int] | None, duplicates: list[int] | None = None
) -> list[str]:
    """Check a stage graph: unique ids, inputs exist, no cycles, no fan-out, an entry and a
    final stage: what the orchestrator can execute.

    Shared by topologies and by the graphs legacy YAMLs declare (`engine_input_source`).
    """
    problems = [f"duplicate stage_id {d}" for d in duplicates or []]
    if not inputs:
        return problems + ["the pipeline has no stages"]
    for sid, srcs in sorted(inputs.items()):
        for src in srcs:
            if src not in inputs:
                problems.append(f"stage {sid} takes input from stage {src}, which does not exist")
            elif src == sid:
                problems.append(f"stage {sid} takes its own output as input")
    consumers: dict[int, list[int]] = {}
    for sid, srcs in sorted(inputs.items()):
        for src in dict.fromkeys(srcs):
            if src in inputs and src != sid:
                consumers.setdefault(src, []).append(sid)
    for src, dsts in sorted(consumers.items()):
        if len(dsts) > 1:
            # The orchestrator hands each stage's output to exactly one consumer (one connector
            # put, released by its one reader); a second consumer would never receive it.
            problems.append(
                f"stage {src} feeds stages {dsts}: one stage's output can go to only one stage "
                "(fan-out is not supported yet)"
            )
    if not any(not srcs for srcs in inputs.values()):
        problems.append("no entry stage (every stage waits for another one)")
    cycle = _find_cycle(inputs)
    if cycle:
        problems.append("cycle between stages " + " -> ".join(map(str, cycle)))
    if finals is not None and not finals:
        problems.append("no stage is marked as the final output")
    return problems


def _find_cycle(inputs: dict[int, list[int]]) -> list[int] | None:
    state: dict[int, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: int, path: list[int]) -> list[int] | None:
        state[node] = 1
        for src in inputs.get(node, []):
            if src not in inputs or src == node:
                continue
            if state.get(src) == 1:
                return path[path.index(src) :] + [src] if src in path else [src, node, src]
            if src not in state:
                found = visit(src, path + [src])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(inputs):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None
