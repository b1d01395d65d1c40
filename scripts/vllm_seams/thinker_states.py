"""The seams of the thinker's hidden-state extraction (vllm_omni_plugin/models/thinker_states):

- `worker_cls` picks our worker, a subclass of vLLM's own (CPU: `CPUWorker`, GPU: `Worker`),
  whose `init_device` builds the runner into `self.model_runner`;
- the V1 model runner (`GPUModelRunner`, which `CPUModelRunner` subclasses): `load_model`,
  `execute_model(scheduler_output, ...)`, `_model_forward` (called with keyword inputs, one call
  per step), `input_batch.req_ids` (the flattened batch's order), `use_aux_hidden_state_outputs`
  (the dummy run and the step unpack `(hidden, aux)` when it is up);
- `VLLM_USE_V2_MODEL_RUNNER` (the stage turns V2 off for that engine);
- `SchedulerOutput`: the new and cached requests' `num_computed_tokens`, `num_scheduled_tokens`,
  `finished_req_ids`, the new requests' `sampling_params` (`extra_args` marks a request;
  `skip_reading_prefix_cache`, read by the scheduler's KV cache manager, makes its every prompt
  position run a forward while the engine caches prefixes);
- the thinker's decoder: from 0.29 its `Qwen3MoeLLMModel` adds auxiliary hidden states
  (`_maybe_add_hidden_state`, `hidden_states + residual`, after the deepstack merge) and the
  thinker is `SupportsEagle3`; before, each decoder layer is called as
  `layer(positions, hidden_states, residual)`, which the forward pre-hooks read.
"""

from __future__ import annotations

import ast

from .ast_helpers import class_fields, class_method, params
from .report import Report, _fn
from .source import _find_in_mro, resolve_def

RUNNER = "vllm.v1.worker.gpu_model_runner"
THINKER = "vllm.model_executor.models.qwen3_omni_moe_thinker"
# The first minor whose Qwen3-Omni thinker has auxiliary hidden-state outputs.
AUX_FROM = (0, 29)


def _minor(r: Report) -> tuple[int, int]:
    major, minor = r.src.minor.split(".")[:2]
    return int(major), int(minor)


def _assigns_self(fn: ast.AST, attr: str) -> bool:
    return any(
        isinstance(n, (ast.Assign, ast.AnnAssign))
        and any(
            isinstance(t, ast.Attribute)
            and t.attr == attr
            and isinstance(t.value, ast.Name)
            and t.value.id == "self"
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        )
        for n in ast.walk(fn)
    )


def _builds_in_init_device(cls: ast.ClassDef, attr: str) -> bool:
    """`init_device`, or a method of the class it calls through `self.`, sets `self.<attr>`."""
    seen: set[str] = set()
    todo = ["init_device"]
    while todo:
        name = todo.pop()
        fn = class_method(cls, name)
        if name in seen or fn is None:
            continue
        seen.add(name)
        if _assigns_self(fn, attr):
            return True
        todo.extend(
            n.func.attr
            for n in ast.walk(fn)
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "self"
        )
    return False


def check_thinker_states(r: Report) -> None:
    _check_workers(r)
    _check_runner(r)
    _check_scheduler_output(r)
    _check_thinker(r)
    envs = r.src.module("vllm.envs")
    r.check(
        envs is not None and "VLLM_USE_V2_MODEL_RUNNER" in ast.unparse(envs),
        "thinker states: vllm/envs.py has no VLLM_USE_V2_MODEL_RUNNER",
    )


def _check_workers(r: Report) -> None:
    for module, name in (
        ("vllm.v1.worker.cpu_worker", "CPUWorker"),
        ("vllm.v1.worker.gpu_worker", "Worker"),
    ):
        cls = _fn(r, module, name, "thinker states")
        if not isinstance(cls, ast.ClassDef):
            continue
        r.check(
            _builds_in_init_device(cls, "model_runner"),
            f"thinker states: {name}.init_device no longer builds self.model_runner",
        )
    cpu_runner = _fn(r, "vllm.v1.worker.cpu_model_runner", "CPUModelRunner", "thinker states")
    if isinstance(cpu_runner, ast.ClassDef):
        r.check(
            any(ast.unparse(b) == "GPUModelRunner" for b in cpu_runner.bases),
            "thinker states: the CPU V1 runner no longer subclasses GPUModelRunner",
        )
    parallel = _fn(r, "vllm.config.parallel", "ParallelConfig", "thinker states")
    if isinstance(parallel, ast.ClassDef):
        r.check("worker_cls" in class_fields(parallel), "thinker states: no worker_cls")
    vllm_cfg = _fn(r, "vllm.config.vllm", "VllmConfig", "thinker states")
    if isinstance(vllm_cfg, ast.ClassDef):
        r.check(
            "additional_config" in class_fields(vllm_cfg),
            "thinker states: VllmConfig has no additional_config",
        )


def _check_runner(r: Report) -> None:
    found = resolve_def(r.src, RUNNER, "GPUModelRunner")
    if not r.check(found is not None, f"thinker states: {RUNNER} has no GPUModelRunner"):
        return
    module, cls = found
    for name in ("load_model", "execute_model", "_model_forward", "_dummy_run", "__init__"):
        r.check(
            _find_in_mro(r.src, module, cls, name) is not None,
            f"thinker states: GPUModelRunner has no {name}",
        )
    execute = class_method(cls, "execute_model")
    if execute is not None:
        r.check(
            params(execute, True).positional[:1] == ["scheduler_output"],
            "thinker states: GPUModelRunner.execute_model(scheduler_output, ...) changed",
        )
        calls = [
            n
            for n in ast.walk(execute)
            if isinstance(n, ast.Call) and ast.unparse(n.func) == "self._model_forward"
        ]
        r.check(
            len(calls) == 1
            and not calls[0].args
            and {"inputs_embeds", "input_ids"} <= {k.arg for k in calls[0].keywords},
            "thinker states: execute_model no longer calls self._model_forward once, by keyword",
        )
    init = class_method(cls, "__init__")
    r.check(
        init is not None and _assigns_self(init, "use_aux_hidden_state_outputs"),
        "thinker states: GPUModelRunner.__init__ no longer sets use_aux_hidden_state_outputs",
    )
    dummy = class_method(cls, "_dummy_run")
    r.check(
        dummy is not None and "use_aux_hidden_state_outputs" in ast.unparse(dummy),
        "thinker states: _dummy_run no longer unpacks aux outputs by use_aux_hidden_state_outputs",
    )
    batch = resolve_def(r.src, "vllm.v1.worker.gpu_input_batch", "InputBatch")
    r.check(
        batch is not None and class_method(batch[1], "req_ids") is not None,
        "thinker states: InputBatch.req_ids is gone",
    )


def _check_scheduler_output(r: Report) -> None:
    want = {
        "SchedulerOutput": {
            "scheduled_new_reqs",
            "scheduled_cached_reqs",
            "num_scheduled_tokens",
            "finished_req_ids",
        },
        "NewRequestData": {"req_id", "num_computed_tokens", "sampling_params"},
        "CachedRequestData": {"req_ids", "num_computed_tokens"},
    }
    for name, fields in want.items():
        cls = _fn(r, "vllm.v1.core.sched.output", name, "thinker states")
        if isinstance(cls, ast.ClassDef):
            missing = fields - set(class_fields(cls))
            r.check(not missing, f"thinker states: {name} lost {sorted(missing)}")
    sp = _fn(r, "vllm.sampling_params", "SamplingParams", "thinker states")
    if isinstance(sp, ast.ClassDef):
        r.check("extra_args" in class_fields(sp), "thinker states: SamplingParams.extra_args")
        r.check(
            "skip_reading_prefix_cache" in class_fields(sp),
            "thinker states: SamplingParams.skip_reading_prefix_cache",
        )
    manager = _fn(r, "vllm.v1.core.kv_cache_manager", "KVCacheManager", "thinker states")
    if isinstance(manager, ast.ClassDef):
        r.check(
            "skip_reading_prefix_cache" in ast.unparse(manager),
            "thinker states: the KV cache manager no longer reads skip_reading_prefix_cache",
        )
    tp = resolve_def(r.src, "vllm.distributed", "get_tensor_model_parallel_rank")
    r.check(tp is not None, "thinker states: vllm.distributed.get_tensor_model_parallel_rank")


def _check_thinker(r: Report) -> None:
    llm = _fn(r, THINKER, "Qwen3MoeLLMModel", "thinker states")
    if not isinstance(llm, ast.ClassDef):
        return
    forward = class_method(llm, "forward")
    text = ast.unparse(forward) if forward is not None else ""
    r.check(
        "layer(positions, hidden_states, residual)" in text,
        "thinker states: the thinker no longer calls layer(positions, hidden_states, residual)",
    )
    if _minor(r) < AUX_FROM:
        return
    r.check(
        "_maybe_add_hidden_state(aux_hidden_states, layer_idx + 1, hidden_states, residual)"
        in text,
        "thinker states: the thinker's aux hidden state k is no longer layer k's input",
    )
    thinker = _fn(r, THINKER, "Qwen3OmniMoeThinkerForConditionalGeneration", "thinker states")
    if isinstance(thinker, ast.ClassDef):
        r.check(
            any(ast.unparse(b) == "SupportsEagle3" for b in thinker.bases),
            "thinker states: the thinker is no longer SupportsEagle3",
        )
    mixin = resolve_def(r.src, "vllm.model_executor.models.interfaces", "EagleModelMixin")
    add = class_method(mixin[1], "_maybe_add_hidden_state") if mixin else None
    r.check(
        add is not None and "hidden_states + residual" in ast.unparse(add),
        "thinker states: EagleModelMixin._maybe_add_hidden_state no longer adds the residual",
    )
    eagle3 = resolve_def(r.src, "vllm.model_executor.models.interfaces", "SupportsEagle3")
    r.check(
        eagle3 is not None and class_method(eagle3[1], "set_aux_hidden_state_layers") is not None,
        "thinker states: SupportsEagle3.set_aux_hidden_state_layers is gone",
    )
