"""The seams of a pipeline's chat stage (vllm_omni_plugin/serving/text_engine.py, speech.py,
chat_routes.py; stages/ar_text.py): vLLM's front-end parts run in the API server and vLLM's
engine request crosses to the stage, so the methods and fields used on them (not only the names
imported, which project.py checks) must stay where they are in every minor.
"""

from __future__ import annotations

import ast

from .ast_helpers import class_fields, class_method, params
from .report import Report, _fn


def _method(r: Report, module: str, cls_name: str, name: str):
    cls = _fn(r, module, cls_name, "chat")
    fn = class_method(cls, name) if isinstance(cls, ast.ClassDef) else None
    r.check(fn is not None, f"chat: {module}.{cls_name} has no {name}")
    return fn


def check_chat_seams(r: Report) -> None:
    # text_engine.encode_request: InputProcessor.process_inputs(request_id, prompt, params, *,
    # supported_tasks, arrival_time, tokenization_kwargs, trace_headers, priority).
    fn = _method(r, "vllm.v1.engine.input_processor", "InputProcessor", "process_inputs")
    if fn is not None:
        p = params(fn, drop_first=True)
        r.check(
            p.positional[:3] == ["request_id", "prompt", "params"]
            and {"supported_tasks", "arrival_time", "tokenization_kwargs", "trace_headers"}
            | {"priority"}
            <= p.names,
            "chat: InputProcessor.process_inputs(request_id, prompt, params, supported_tasks, "
            "arrival_time, tokenization_kwargs, trace_headers, priority) changed",
        )
    # stages/ar_text.run_text: AsyncLLM.generate(EngineCoreRequest, params, id, prompt_text=).
    fn = _method(r, "vllm.v1.engine.async_llm", "AsyncLLM", "generate")
    if fn is not None:
        r.check(
            "prompt_text" in params(fn, drop_first=True).names, "chat: generate lost prompt_text"
        )
    add = _method(r, "vllm.v1.engine.async_llm", "AsyncLLM", "add_request")
    if add is not None:
        r.check(
            "isinstance(prompt, EngineCoreRequest)" in ast.unparse(add),
            "chat: AsyncLLM.add_request no longer takes a ready EngineCoreRequest",
        )
    req = _fn(r, "vllm.v1.engine", "EngineCoreRequest", "chat")
    if isinstance(req, ast.ClassDef):
        r.check(
            {"request_id", "prompt_token_ids", "sampling_params"} <= set(class_fields(req)),
            "chat: EngineCoreRequest lost request_id/prompt_token_ids/sampling_params",
        )
    # text_engine._Collector merges outputs with vLLM's own RequestOutput.add.
    fn = _method(r, "vllm.outputs", "RequestOutput", "add")
    if fn is not None:
        r.check(
            params(fn, drop_first=True).positional[:2] == ["next_output", "aggregate"],
            "chat: RequestOutput.add(next_output, aggregate) changed",
        )
    # speech.py: vLLM's chat handler renders, the request makes its sampling params.
    serving = "vllm.entrypoints.openai.chat_completion.serving"
    fn = _method(r, serving, "OpenAIServingChat", "render_chat_request")
    if fn is not None:
        r.check(
            params(fn, drop_first=True).positional == ["request"],
            "chat: OpenAIServingChat.render_chat_request(request) changed",
        )
    init = _method(r, serving, "OpenAIServingChat", "__init__")
    if init is not None:
        r.check(
            "self.default_sampling_params" in ast.unparse(init),
            "chat: OpenAIServingChat no longer sets default_sampling_params",
        )
    protocol = "vllm.entrypoints.openai.chat_completion.protocol"
    fn = _method(r, protocol, "ChatCompletionRequest", "to_sampling_params")
    if fn is not None:
        r.check(
            params(fn, drop_first=True).positional[:2] == ["max_tokens", "default_sampling_params"],
            "chat: ChatCompletionRequest.to_sampling_params(max_tokens, defaults) changed",
        )
    # chat_routes.py: vLLM's chat route takes (request, raw_request); we call it by keyword.
    router = "vllm.entrypoints.openai.chat_completion.api_router"
    route = _fn(r, router, "create_chat_completion", "chat")
    if isinstance(route, (ast.FunctionDef, ast.AsyncFunctionDef)):
        r.check(
            params(route).positional == ["request", "raw_request"],
            "chat: vLLM's create_chat_completion route no longer takes (request, raw_request)",
        )
    # text_engine.TextEngine: a front end built with `_api_process_count` above 1 gets vLLM's
    # processor-only multimodal cache (processed items kept, each sent in full).
    args = _fn(r, "vllm.engine.arg_utils", "EngineArgs", "chat")
    if isinstance(args, ast.ClassDef):
        r.check(
            "_api_process_count" in class_fields(args), "chat: EngineArgs lost _api_process_count"
        )
    # The factory's module: multimodal/cache/factories.py from 0.31, multimodal/registry.py before.
    homes = ("vllm/multimodal/cache/factories.py", "vllm/multimodal/registry.py")
    texts = [r.src.read(home) or "" for home in homes]
    factory = next((t for t in texts if "def processor_cache_from_config" in t), "")
    r.check(
        "is_ipc_supported = parallel_config._api_process_count == 1" in factory
        and '"processor_only"' in factory,
        "chat: the multimodal processor cache no longer turns processor-only when "
        "_api_process_count is above 1",
    )
