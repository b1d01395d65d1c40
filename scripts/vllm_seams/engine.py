"""The seams on the engine side: the plugin groups and registries we register into
(`ModelRegistry`, `KVConnectorFactory`, the scheduler and `SchedulerConfig`, logits processors
by FQCN), the worker process title, and `Worker.determine_available_memory` skipping its
profiling when `kv_cache_memory_bytes` is set.
"""

from __future__ import annotations

import ast

from .ast_helpers import class_fields, class_method, params, string_constants
from .report import Report, _fn
from .source import resolve, resolve_def, top_names
from .tables import engine_fields_mod


def check_registration(r: Report) -> None:
    src = r.src
    plugins = src.module("vllm.plugins")
    strings = string_constants(plugins) if plugins else set()
    for group in ("vllm.general_plugins", "vllm.endpoint_plugins"):
        r.check(
            group in strings, f"plugins: vllm/plugins/__init__.py no longer names the group {group}"
        )
    _fn(r, "vllm.plugins", "load_general_plugins", "plugins")
    # The AR stage hands vLLM its logits processor as "module:Class" in the engine argument
    # (the entry-point group would turn off model runner V2 in every engine on 0.26-0.30).
    lp = src.module("vllm.v1.sample.logits_processor")
    r.check(
        lp is not None
        and "_load_logitsprocs_by_fqcns"
        in {f.name for f in ast.walk(lp) if isinstance(f, ast.FunctionDef)},
        "plugins: vllm/v1/sample/logits_processor no longer loads logits processors by FQCN",
    )
    reg = resolve(src, "vllm", "ModelRegistry")
    reg_cls = None
    if r.check(
        reg is not None and isinstance(reg.node, ast.Assign),
        "models: vllm.ModelRegistry is not an instance",
    ):
        call = reg.node.value
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
            reg_cls = resolve_def(src, reg.module, call.func.id)
    if r.check(reg_cls is not None, "models: cannot find ModelRegistry's class"):
        cls = reg_cls[1]
        reg_m, archs = class_method(cls, "register_model"), class_method(cls, "get_supported_archs")
        r.check(
            reg_m is not None and params(reg_m, True).positional[:2] == ["model_arch", "model_cls"],
            "models: ModelRegistry.register_model(model_arch, model_cls) changed",
        )
        r.check(archs is not None, "models: ModelRegistry.get_supported_archs is gone")
    fac = _fn(r, "vllm.distributed.kv_transfer.kv_connector.factory", "KVConnectorFactory", "kv")
    if isinstance(fac, ast.ClassDef):
        m = class_method(fac, "register_connector")
        r.check(
            m is not None
            and params(m, True).positional[:3] == ["name", "module_path", "class_name"],
            "kv: KVConnectorFactory.register_connector(name, module_path, class_name) changed",
        )
        r.check(
            "_registry" in class_fields(fac)
            or "_registry" in top_names(ast.Module(body=fac.body, type_ignores=[])),
            "kv: KVConnectorFactory._registry is gone",
        )
    sched = _fn(r, "vllm.v1.core.sched.scheduler", "Scheduler", "scheduler")
    if isinstance(sched, ast.ClassDef):
        init = class_method(sched, "__init__")
        r.check(
            init is not None and params(init, True).positional[:1] == ["vllm_config"],
            "scheduler: Scheduler.__init__'s first parameter is no longer vllm_config",
        )
    asched = _fn(r, "vllm.v1.core.sched.async_scheduler", "AsyncScheduler", "scheduler")
    if isinstance(asched, ast.ClassDef):
        r.check(
            any(isinstance(b, ast.Name) and b.id == "Scheduler" for b in asched.bases),
            "scheduler: AsyncScheduler no longer subclasses Scheduler",
        )
    cfg = _fn(r, "vllm.config.scheduler", "SchedulerConfig", "scheduler")
    if isinstance(cfg, ast.ClassDef):
        got = set(class_fields(cfg))
        r.check(
            {"async_scheduling", "scheduler_cls"} <= got,
            "scheduler: SchedulerConfig lost async_scheduling/scheduler_cls",
        )


def check_worker_title(r: Report) -> None:
    src = r.src
    title = _fn(r, "vllm.utils.system_utils", "set_process_title", "title")
    if title is not None:
        p = params(title)
        default = dict(
            zip(reversed(p.positional), reversed(title.args.defaults), strict=False)
        ).get("prefix")
        r.check(
            default is not None
            and engine_fields_mod.VLLM_PROCESS_NAME_PREFIX_ENV in ast.unparse(default),
            "title: set_process_title's prefix no longer defaults to envs.VLLM_PROCESS_NAME_PREFIX",
        )
        fstrings = [ast.unparse(n) for n in ast.walk(title) if isinstance(n, ast.JoinedStr)]
        r.check(
            "f'{prefix}::{name}'" in fstrings,
            f"title: set_process_title no longer sets '{{prefix}}::{{name}}' ({fstrings})",
        )
    envs = src.module("vllm.envs")
    key = engine_fields_mod.VLLM_PROCESS_NAME_PREFIX_ENV
    default_ok = envs is not None and any(
        isinstance(n, ast.Call) and [ast.unparse(a) for a in n.args] == [repr(key), "'VLLM'"]
        for n in ast.walk(envs)
    )
    r.check(default_ok, f"title: {key} no longer defaults to 'VLLM' in vllm/envs.py")
    ex = src.module("vllm.v1.executor.multiproc_executor")
    name = engine_fields_mod.VLLM_WORKER_PROCESS_NAME
    r.check(
        ex is not None
        and any(
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id == "set_process_title"
            and any(isinstance(k.value, ast.Constant) and k.value.value == name for k in n.keywords)
            for n in ast.walk(ex)
        ),
        f"title: the multiproc executor no longer titles its workers {name!r}",
    )


def check_fixed_kv_cache_skips_profiling(r: Report) -> None:
    found = resolve_def(r.src, "vllm.v1.worker.gpu_worker", "Worker")
    fn = class_method(found[1], "determine_available_memory") if found else None
    r.check(
        fn is not None, "memory: vllm.v1.worker.gpu_worker.Worker has no determine_available_memory"
    )
    if fn is None:
        return

    def profiles(node: ast.AST) -> bool:
        return any(
            isinstance(n, ast.Call) and ast.unparse(n.func).endswith("memory_profiling")
            for n in ast.walk(node)
        )

    early = [
        n
        for n in fn.body
        if isinstance(n, ast.If)
        and "kv_cache_memory_bytes" in ast.unparse(n.test)
        and any(isinstance(x, ast.Return) for x in ast.walk(n))
        and not profiles(n)
    ]
    first_profile = next((i for i, n in enumerate(fn.body) if profiles(n)), len(fn.body))
    r.check(
        bool(early) and fn.body.index(early[0]) < first_profile,
        "memory: determine_available_memory no longer returns before memory_profiling when "
        "kv_cache_memory_bytes is set",
    )


def check_talker_runner(r: Report) -> None:
    """models/qwen3_omni/talker_runner.py: the talker's worker builds vLLM's V1 model runner in
    `init_device` and mixes `TalkerRunnerMixin` into it, which overrides `_preprocess`,
    `_sample`, `_update_states`, `execute_model`, `_init_mrope_positions` (setting a request
    state's `mrope_positions` / `mrope_position_delta`) and `capture_model` (which the worker calls
    after the KV cache is allocated, only without `enforce_eager`; the runner's returns early
    when `compilation_config.cudagraph_mode` is NONE), marks prompt-embeds rows of the input
    batch's token table and sampling metadata, reads `input_batch.req_ids`, `requests` (their
    `num_computed_tokens`, `num_prompt_tokens`, `sampling_params`), `get_model()`, `device`,
    `scheduler_config`, `compilation_config` and `parallel_config`, and hands the frames out
    as the step's `LogprobsTensors`, which the scheduler slices per request (`slice_request`)
    for requests that asked for logprobs; under async scheduling `sample_tokens` hands those
    tensors to `AsyncGPUModelRunnerOutput`, whose `get_output` returns them. The talker engine's
    `generation_config` folder is the one `ModelConfig` reads special ids from."""
    src = r.src
    for module, name in (
        ("vllm.v1.worker.gpu_worker", "Worker"),
        ("vllm.v1.worker.cpu_worker", "CPUWorker"),
    ):
        worker = _fn(r, module, name, "talker")
        if isinstance(worker, ast.ClassDef):
            init = class_method(worker, "init_device")
            # init_device itself, or a method of the worker it calls (0.32: a helper).
            bodies = [init] if init is not None else []
            for node in ast.walk(init) if init is not None else ():
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "self"
                ):
                    helper = class_method(worker, node.func.attr)
                    bodies += [helper] if helper is not None else []
            r.check(
                any("self.model_runner" in ast.unparse(b) for b in bodies),
                f"talker: {name}.init_device no longer builds self.model_runner",
            )
    worker = _fn(r, "vllm.v1.worker.gpu_worker", "Worker", "talker")
    if isinstance(worker, ast.ClassDef):
        # compile_or_warm_up_model itself, or (0.33) its `_compile_or_warm_up_model` helper.
        names = ("compile_or_warm_up_model", "_compile_or_warm_up_model")
        warm = [class_method(worker, name) for name in names]
        text = "".join(ast.unparse(m) for m in warm if m is not None)
        r.check(
            "self.model_runner.capture_model()" in text and "enforce_eager" in text,
            "talker: Worker.compile_or_warm_up_model no longer calls the runner's "
            "capture_model (after the KV cache, unless enforce_eager)",
        )
    runner = _fn(r, "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "talker")
    if isinstance(runner, ast.ClassDef):
        want = {
            "_preprocess": ["scheduler_output", "num_input_tokens", "intermediate_tensors"],
            "_sample": ["logits", "spec_decode_metadata"],
            "execute_model": ["scheduler_output"],
            "get_model": [],
            "_update_states": ["scheduler_output"],
            "capture_model": [],
            "_init_mrope_positions": ["req_state"],
        }
        for name, args in want.items():
            m = class_method(runner, name)
            r.check(
                m is not None and params(m, True).positional[: len(args)] == args,
                f"talker: GPUModelRunner.{name}({', '.join(args)}) changed",
            )
        text = ast.unparse(runner)
        for attr in (
            "self.input_batch.req_ids",
            "self.requests",
            "self.sampler(",
            "self.device =",
            "self.scheduler_config =",
            "self.compilation_config =",
            "self.parallel_config =",
        ):
            r.check(attr in text, f"talker: GPUModelRunner no longer uses {attr}")
        capture = class_method(runner, "capture_model")
        r.check(
            capture is not None and "CUDAGraphMode.NONE" in ast.unparse(capture),
            "talker: GPUModelRunner.capture_model no longer skips cudagraph_mode NONE",
        )
        # Under async scheduling the frames leave in the async output, which copies the
        # sampler output's logprobs tensors (the ones `_sample` returns) to the host.
        sample = class_method(runner, "sample_tokens")
        text = ast.unparse(sample) if sample is not None else ""
        r.check(
            "self._sample(" in text
            and "AsyncGPUModelRunnerOutput(" in text
            and "logprobs_tensors=sampler_output.logprobs_tensors" in text,
            "talker: GPUModelRunner.sample_tokens no longer hands _sample's logprobs tensors "
            "to its async output",
        )
    async_out = _fn(r, "vllm.v1.worker.gpu_model_runner", "AsyncGPUModelRunnerOutput", "talker")
    if isinstance(async_out, ast.ClassDef):
        get = class_method(async_out, "get_output")
        text = ast.unparse(get) if get is not None else ""
        r.check(
            "self._logprobs_tensors_cpu" in text and "output.logprobs = logprobs_lists" in text,
            "talker: AsyncGPUModelRunnerOutput.get_output no longer returns the logprobs",
        )
    # talker_engine_args names a generation config folder of the talker's own (the checkpoint's
    # is the thinker's): vLLM reads the special ids from that folder, not from the model's.
    model_config = _fn(r, "vllm.config.model", "ModelConfig", "talker")
    if isinstance(model_config, ast.ClassDef):
        read = class_method(model_config, "try_get_generation_config")
        text = ast.unparse(read) if read is not None else ""
        r.check(
            "try_get_generation_config(self.generation_config," in text,
            "talker: ModelConfig.try_get_generation_config no longer reads a generation_config "
            "folder",
        )
    state = _fn(r, "vllm.v1.worker.gpu_input_batch", "CachedRequestState", "talker")
    if isinstance(state, ast.ClassDef):
        text = ast.unparse(state)
        for attr in (
            "num_computed_tokens",
            "self.num_prompt_tokens",
            "sampling_params",
            "prompt_embeds",
            "mrope_positions",
            "mrope_position_delta",
        ):
            r.check(attr in text, f"talker: CachedRequestState has no {attr}")
    batch = _fn(r, "vllm.v1.worker.gpu_input_batch", "InputBatch", "talker")
    if isinstance(batch, ast.ClassDef):
        text = ast.unparse(batch)
        for attr in (
            "self.token_ids_cpu",
            "self.num_prompt_tokens",
            "self.vocab_size",
            "self.req_id_to_index",
            "self.sampling_metadata",
            "self._make_prompt_token_ids_cpu_tensor()",
        ):
            r.check(attr in text, f"talker: InputBatch no longer has {attr}")
    meta = _fn(r, "vllm.v1.sample.metadata", "SamplingMetadata", "talker")
    if isinstance(meta, ast.ClassDef):
        want = {"all_greedy", "temperature", "generators", "prompt_token_ids"}
        r.check(
            want <= set(class_fields(meta)),
            f"talker: SamplingMetadata lost one of {sorted(want)}",
        )
    new_req = _fn(r, "vllm.v1.core.sched.output", "NewRequestData", "talker")
    if isinstance(new_req, ast.ClassDef):
        r.check(
            {"req_id", "prompt_embeds"} <= set(class_fields(new_req)),
            "talker: NewRequestData lost req_id/prompt_embeds",
        )
    lp = _fn(r, "vllm.v1.outputs", "LogprobsTensors", "talker")
    if isinstance(lp, ast.ClassDef):
        r.check(
            list(class_fields(lp))[:3] == ["logprob_token_ids", "logprobs", "selected_token_ranks"],
            "talker: LogprobsTensors' first fields changed",
        )
    so = _fn(r, "vllm.v1.outputs", "SamplerOutput", "talker")
    if isinstance(so, ast.ClassDef):
        r.check(
            {"sampled_token_ids", "logprobs_tensors"} <= set(class_fields(so)),
            "talker: SamplerOutput lost sampled_token_ids/logprobs_tensors",
        )
    sched = src.module("vllm.v1.core.sched.scheduler")
    r.check(
        sched is not None and "slice_request" in ast.unparse(sched),
        "talker: the scheduler no longer slices sample logprobs per request",
    )
