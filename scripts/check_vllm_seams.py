#!/usr/bin/env python3
"""Check that a vLLM release still has every seam vllm-omni-plugin relies on.

    python scripts/check_vllm_seams.py SOURCE [SOURCE ...]

SOURCE is a vLLM wheel (read with zipfile, nothing installed) or a directory that holds the
`vllm` package (e.g. a venv's site-packages). The sources are read with `ast`; nothing of
vLLM is imported, so any minor can be checked on any machine. What is checked, for the minor
the source declares (its dist-info or vllm/_version.py):

* the minor is inside the window (`SERVE_SEAMS` in entry_points/patches.py, and the engine-field
  table in vllm_omni_plugin/config/vllm_engine_fields.py);
* every `from vllm... import X` / `import vllm...` in the project resolves to a module and a
  name defined there (following re-exports and vLLM's lazy `MODULE_ATTRS`);
* every call from project code to a vLLM function or class uses keyword names the callee
  accepts;
* every project class that subclasses a vLLM class: methods it (or its project mixins) defines
  that vLLM also defines are overrides with the same parameter names, the others do not
  collide, and vLLM's abstract methods are implemented;
* the serve seams of that minor's `SERVE_SEAMS` row: the API-server module, the patched
  functions and their signatures, that their callers look the patched names up as module
  globals, the endpoint-plugin attach/state hooks and interface, `load_endpoint_plugins`;
* the CLI seams: `AsyncEngineArgs.add_cli_args` -> `load_general_plugins()` and
  `EngineArgs.add_cli_args`; `EngineArgs.create_engine_config` (after `__post_init__` ->
  `load_general_plugins()`) as `LLMEngine` / `AsyncLLM.from_engine_args` call it; `vllm serve`'s `cmd` -> `run_headless`, `validate` ->
  `validate_parsed_serve_args`; the dests of the multi-API-server / data-parallel flags we refuse;
* plugin groups, `ModelRegistry.register_model` / `get_supported_archs`,
  `KVConnectorFactory.register_connector` / `_registry`, `SchedulerConfig` fields;
* the worker process title (`VLLM_PROCESS_NAME_PREFIX` + "::" + "Worker");
* `Worker.determine_available_memory` returns early, before its free-memory profiling, when
  `kv_cache_memory_bytes` is set (stages sharing a GPU start together on that, orchestrator.py);
* a pipeline's chat stage: `InputProcessor.process_inputs`, `AsyncLLM.generate(prompt_text=)`
  and its ready-EngineCoreRequest path, `EngineCoreRequest` fields, `RequestOutput.add`,
  `OpenAIServingChat.render_chat_request` / `default_sampling_params`,
  `ChatCompletionRequest.to_sampling_params`, vLLM's chat route's parameters;
* the talker's V1 model-runner seams (`check_talker_runner`): the worker builds its runner in
  `init_device`; `_preprocess` / `_sample` / `execute_model` / `get_model` /
  `_init_mrope_positions` / `capture_model` (called after the KV cache, unless enforce_eager),
  the request state fields, `LogprobsTensors` / `SamplerOutput`, per-request logprobs slicing,
  the async output carrying `_sample`'s logprobs tensors;
* `engine_fields(minor)` equals the wheel's EngineArgs/AsyncEngineArgs fields, both ways, with
  matching coarse types where the annotation is a plain type.

Exit status 0 when everything is found, 1 otherwise (each problem printed on its own line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The checks live, by concept, in scripts/vllm_seams/; this script lists and runs them. ROOT,
# patches, engine_fields_mod and the module `project` (whose ROOT the project checks print paths
# against) are re-exported for tests/vllm_window/test_seams.py.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_seams import project  # noqa: E402, F401
from vllm_seams.chat import check_chat_seams  # noqa: E402
from vllm_seams.engine import (  # noqa: E402
    check_fixed_kv_cache_skips_profiling,
    check_registration,
    check_talker_runner,
    check_worker_title,
)
from vllm_seams.project import (  # noqa: E402
    ProjectFile,
    check_project_calls,
    check_project_imports,
    check_project_subclasses,
    project_files,
)
from vllm_seams.report import Report  # noqa: E402
from vllm_seams.serve import check_cli_seams, check_serve_seams  # noqa: E402
from vllm_seams.source import Source  # noqa: E402
from vllm_seams.tables import ROOT, engine_fields_mod, patches  # noqa: E402, F401
from vllm_seams.thinker_states import check_thinker_states  # noqa: E402
from vllm_seams.window import check_engine_fields, check_window  # noqa: E402

CHECKS = (
    check_window,
    check_serve_seams,
    check_cli_seams,
    check_registration,
    check_worker_title,
    check_fixed_kv_cache_skips_profiling,
    check_engine_fields,
    check_chat_seams,
    check_talker_runner,
    check_thinker_states,
)


def run(
    path: Path,
    files: list[ProjectFile] | None = None,
    overrides: dict[str, str | None] | None = None,
) -> Report:
    src = Source(path, overrides)
    r = Report(src)
    files = files if files is not None else project_files()
    for pf in files:
        pf.vllm_names.clear()
    check_project_imports(r, files)
    check_project_calls(r, files)
    check_project_subclasses(r, files)
    for check in CHECKS:
        check(r)
    return r


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="+", type=Path, help="vLLM wheels or site-packages dirs")
    args = parser.parse_args(argv)
    files = project_files()
    failed = 0
    for path in args.sources:
        if not path.exists():
            print(f"MISSING {path}")
            failed += 1
            continue
        r = run(path, files)
        status = "OK" if not r.problems else "FAIL"
        print(
            f"{status} vLLM {r.src.version} ({path.name}): {r.checked} checks, {len(r.problems)} problems"
        )
        for problem in r.problems:
            print(f"  - {problem}")
        failed += bool(r.problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
