"""The `vllm-omni-plugin` console script."""

from __future__ import annotations

import argparse
import sys


def _make_tiny_model(args: argparse.Namespace) -> int:
    from vllm_omni_plugin.testing.tiny_models import build_tiny_model

    path = build_tiny_model(args.kind, args.out_dir, seed=args.seed)
    print(f"wrote tiny {args.kind} model to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-omni-plugin")
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random-weight checkpoint")
    tiny.add_argument("kind", choices=["glm-image", "qwen-image", "flux"])
    tiny.add_argument("out_dir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_make_tiny_model)

    try:
        from vllm_omni_plugin.config.cli import add_config_commands
    except ImportError:  # config package not present yet
        pass
    else:
        add_config_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
