"""Build vLLM's API app in-process (no engine) for `vllm serve ARGS` and print its routes as JSON.

Run in a fresh interpreter with the VLLM_PLUGINS under test, so that plugin loading happens
exactly as in `vllm serve`: `python route_dump.py TASKS -- SERVE_ARGS...`.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    tasks = tuple(t for t in sys.argv[1].split(",") if t)
    serve_args = sys.argv[sys.argv.index("--") + 1 :]

    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.plugins import load_general_plugins
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    load_general_plugins()  # what `vllm serve` does before parsing
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(serve_args)
    app = build_app(args, tasks, None)
    routes = sorted(
        [getattr(r, "path", ""), sorted(getattr(r, "methods", None) or []), type(r).__name__]
        for r in app.routes
    )
    from vllm_omni_plugin.entry_points import patches

    print(
        json.dumps(
            {
                "routes": routes,
                "openapi": app.openapi(),
                "serve_patches": patches.serve_patches_installed(),
                "stage_config": getattr(args, "stage_config", "absent"),
            }
        )
    )


if __name__ == "__main__":
    main()
