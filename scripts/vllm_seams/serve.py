"""The seams `vllm serve` reaches us through: the API-server functions entry_points/patches.py
patches for the minor's `SERVE_SEAMS` row (their signatures, and that their callers look them
up as module globals), the endpoint-plugin hooks and interface, `vllm/envs.py`'s keys, and the
CLI (`add_cli_args` -> `load_general_plugins()`, `create_engine_config`, `run_headless`,
`validate_parsed_serve_args`, the dests of the serve flags we refuse).
"""

from __future__ import annotations

import ast

from .ast_helpers import (
    _decorators,
    calls_attr,
    calls_global,
    class_fields,
    class_method,
    imports_in_body,
    params,
    string_constants,
)
from .report import Report, _fn
from .source import resolve, resolve_def, top_names
from .tables import ROOT, engine_fields_mod, patches


def check_serve_seams(r: Report) -> None:
    src = r.src
    seams = patches.SERVE_SEAMS.get(src.minor)
    if seams is None:
        return
    api = seams.api_server
    if not r.check(src.module(api) is not None, f"serve: no module {api}"):
        return
    top = top_names(src.module(api))
    build = top.get("build_async_engine_client")
    if r.check(
        isinstance(build, ast.AsyncFunctionDef),
        f"serve: {api}.build_async_engine_client is not defined there",
    ):
        p = params(build)
        r.check(
            "asynccontextmanager" in _decorators(build),
            f"serve: {api}.build_async_engine_client is not an asynccontextmanager",
        )
        r.check(
            p.positional[:1] == ["args"] and {"usage_context", "client_config"} <= set(p.kwonly),
            f"serve: {api}.build_async_engine_client signature changed: {p}",
        )
    init = _fn(r, api, "init_app_state", "serve")
    if init is not None:
        r.check(
            params(init).positional[:4] == ["engine_client", "state", "args", "supported_tasks"],
            f"serve: init_app_state signature changed: {params(init)}",
        )
    worker = top.get("run_server_worker")
    if r.check(
        isinstance(worker, ast.AsyncFunctionDef),
        f"serve: {api}.run_server_worker is not defined there",
    ):
        r.check(
            calls_global(worker, "build_async_engine_client"),
            f"serve: {api}.run_server_worker no longer calls build_async_engine_client as a module global",
        )
    bas = top.get("build_and_serve")
    if r.check(
        isinstance(bas, ast.AsyncFunctionDef), f"serve: {api}.build_and_serve is not defined there"
    ):
        r.check(
            calls_global(bas, "init_app_state"),
            f"serve: {api}.build_and_serve no longer calls init_app_state as a module global",
        )
        r.check(
            calls_global(bas, "build_app"),
            f"serve: {api}.build_and_serve no longer calls build_app",
        )
        app = resolve_def(src, api, "build_app")
        if r.check(app is not None, f"serve: {api} has no build_app"):
            attach = [
                n.func.id
                for n in ast.walk(app[1])
                if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name)
                and (f := resolve_def(src, app[0], n.func.id)) is not None
                and imports_in_body(f[1], "vllm.plugins", "load_endpoint_plugins")
                and calls_attr(f[1], "attach_router")
            ]
            r.check(
                bool(attach),
                "serve: build_app no longer calls a function that imports "
                "vllm.plugins.load_endpoint_plugins at call time and calls attach_router",
            )
    state_mod, _, state_fn = seams.plugins_state.partition(":")
    state = _fn(r, state_mod, state_fn, "serve")
    if state is not None:
        r.check(
            params(state).positional[:3] == ["engine_client", "state", "args"]
            and calls_attr(state, "init_state"),
            f"serve: {seams.plugins_state} no longer runs plugin.init_state(engine_client, state, args)",
        )
    if init is not None and state is not None:
        r.check(
            calls_global(init, state_fn), f"serve: vLLM's init_app_state no longer calls {state_fn}"
        )
    load = _fn(r, "vllm.plugins", "load_endpoint_plugins", "plugins")
    if load is not None:
        r.check(
            params(load).positional[:1] == ["supported_tasks"],
            "plugins: load_endpoint_plugins signature changed",
        )
        r.check(
            "VLLM_PLUGINS" in {n.attr for n in ast.walk(load) if isinstance(n, ast.Attribute)},
            "plugins: load_endpoint_plugins no longer reads envs.VLLM_PLUGINS",
        )
    iface = _fn(r, "vllm.plugins.endpoint_plugins.interface", "EndpointPlugin", "endpoint plugins")
    ours = next(
        n
        for n in ast.parse((ROOT / "entry_points" / "endpoints.py").read_text()).body
        if isinstance(n, ast.ClassDef) and n.name == "OmniImagesPlugin"
    )
    if isinstance(iface, ast.ClassDef):
        fields = set(class_fields(iface))
        r.check(
            {"name", "required_tasks"} <= fields,
            f"endpoint plugins: EndpointPlugin fields changed: {sorted(fields)}",
        )
        for meth in ("attach_router", "init_state"):
            theirs, mine = class_method(iface, meth), class_method(ours, meth)
            r.check(
                theirs is not None
                and mine is not None
                and params(theirs).positional == params(mine).positional
                and isinstance(theirs, ast.AsyncFunctionDef)
                == isinstance(mine, ast.AsyncFunctionDef),
                f"endpoint plugins: EndpointPlugin.{meth} differs from OmniImagesPlugin.{meth}",
            )
    env_keys = string_constants(src.module("vllm.envs") or ast.Module(body=[], type_ignores=[]))
    for key in (
        "VLLM_PLUGINS",
        "VLLM_RUST_FRONTEND_PATH",
        engine_fields_mod.VLLM_PROCESS_NAME_PREFIX_ENV,
    ):
        r.check(key in env_keys, f"envs: vllm/envs.py has no {key}")


def check_cli_seams(r: Report) -> None:
    src = r.src
    args_mod = "vllm.engine.arg_utils"
    engine = _fn(r, args_mod, "EngineArgs", "cli")
    async_args = _fn(r, args_mod, "AsyncEngineArgs", "cli")
    if isinstance(engine, ast.ClassDef):
        add = class_method(engine, "add_cli_args")
        r.check(
            add is not None
            and "staticmethod" in _decorators(add)
            and params(add).positional[:1] == ["parser"],
            "cli: EngineArgs.add_cli_args is no longer a staticmethod add_cli_args(parser)",
        )
    if isinstance(async_args, ast.ClassDef):
        add = class_method(async_args, "add_cli_args")
        ok = (
            add is not None
            and calls_global(add, "load_general_plugins")
            or (
                add is not None
                and "load_general_plugins"
                in {n.id for n in ast.walk(add) if isinstance(n, ast.Name)}
            )
        )
        r.check(ok, "cli: AsyncEngineArgs.add_cli_args no longer calls load_general_plugins()")
        r.check(
            add is not None and calls_attr(add, "add_cli_args", on="EngineArgs"),
            "cli: AsyncEngineArgs.add_cli_args no longer calls EngineArgs.add_cli_args on the class",
        )
    # Patch 8: every engine's config comes from `engine_args.create_engine_config(...)`,
    # looked up on EngineArgs, after EngineArgs.__post_init__ has loaded the general plugins.
    if isinstance(engine, ast.ClassDef):
        create = class_method(engine, "create_engine_config")
        r.check(
            create is not None and params(create).positional[:2] == ["self", "usage_context"],
            "cli: EngineArgs has no create_engine_config(self, usage_context, ...)",
        )
        post = class_method(engine, "__post_init__")
        r.check(
            post is not None
            and "load_general_plugins" in {n.id for n in ast.walk(post) if isinstance(n, ast.Name)},
            "cli: EngineArgs.__post_init__ no longer calls load_general_plugins()",
        )
    if isinstance(async_args, ast.ClassDef):
        r.check(
            class_method(async_args, "create_engine_config") is None,
            "cli: AsyncEngineArgs overrides create_engine_config",
        )
    for engine_mod, engine_cls in (
        ("vllm.v1.engine.llm_engine", "LLMEngine"),
        ("vllm.v1.engine.async_llm", "AsyncLLM"),
    ):
        cls = _fn(r, engine_mod, engine_cls, "cli")
        make = class_method(cls, "from_engine_args") if isinstance(cls, ast.ClassDef) else None
        r.check(
            make is not None and calls_attr(make, "create_engine_config", on="engine_args"),
            f"cli: {engine_cls}.from_engine_args no longer calls engine_args.create_engine_config",
        )
    serve_mod = "vllm.entrypoints.cli.serve"
    top = top_names(src.module(serve_mod) or ast.Module(body=[], type_ignores=[]))
    headless = top.get("run_headless")
    r.check(
        isinstance(headless, ast.FunctionDef) and params(headless).positional[:1] == ["args"],
        "cli: vllm/entrypoints/cli/serve.py has no run_headless(args)",
    )
    sub = top.get("ServeSubcommand")
    if r.check(
        isinstance(sub, ast.ClassDef), "cli: no ServeSubcommand in vllm/entrypoints/cli/serve.py"
    ):
        cmd, validate = class_method(sub, "cmd"), class_method(sub, "validate")
        r.check(
            cmd is not None and calls_global(cmd, "run_headless"),
            "cli: ServeSubcommand.cmd no longer calls run_headless as a module global",
        )
        for path in ("run_multi_api_server", "run_dp_supervisor"):
            r.check(
                cmd is not None
                and calls_global(cmd, path)
                and resolve(src, serve_mod, path) is not None,
                f"cli: ServeSubcommand.cmd no longer calls {path} (the mode we refuse moved)",
            )
        r.check(
            validate is not None and calls_global(validate, "validate_parsed_serve_args"),
            "cli: ServeSubcommand.validate no longer calls validate_parsed_serve_args as a module global",
        )
        r.check(
            resolve(src, serve_mod, "validate_parsed_serve_args") is not None,
            "cli: validate_parsed_serve_args does not resolve in vllm/entrypoints/cli/serve.py",
        )
    main = src.module("vllm.entrypoints.cli.main")
    r.check(
        main is not None and calls_attr(main, "validate"),
        "cli: vllm/entrypoints/cli/main.py no longer calls <subcommand>.validate(args)",
    )
    # The dests we refuse with --stage-config: engine fields, or a flag of the serve parser.
    fields = set()
    for cls in (engine, async_args):
        if isinstance(cls, ast.ClassDef):
            fields |= set(class_fields(cls))
    parser_src = resolve(src, serve_mod, "make_arg_parser")
    parser_strings = string_constants(src.module(parser_src.module)) if parser_src else set()
    for dest, flag, _ in patches._REFUSED_SERVE_ARGS:
        r.check(
            dest in fields or flag in parser_strings,
            f"cli: {flag} ({dest}) is neither an engine field nor a serve flag",
        )
