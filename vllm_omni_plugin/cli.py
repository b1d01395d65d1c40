"""The `vllm-omni-plugin` console script."""

from __future__ import annotations

import argparse
import sys


def _make_tiny_model(args: argparse.Namespace) -> int:
    from vllm_omni_plugin.testing.tiny_models import build_tiny_model

    try:
        path = build_tiny_model(
            args.kind, args.out_dir, seed=args.seed, size=args.size, num_layers=args.num_layers
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.size} {args.kind} model to {path}")
    return 0


def _make_tiny_lora(args: argparse.Namespace) -> int:
    from vllm_omni_plugin.diffusion.lora.tiny import build_tiny_lora

    try:
        path = build_tiny_lora(args.model_dir, args.out_dir, rank=args.rank, seed=args.seed)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a rank-{args.rank} LoRA adapter for {args.model_dir} to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    # The builders' own table: a kind they know is a kind this command takes (no second list).
    from vllm_omni_plugin.testing.tiny_models import FULL_KINDS, KINDS, SIZES

    parser = argparse.ArgumentParser(prog="vllm-omni-plugin")
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random-weight checkpoint")
    tiny.add_argument("kind", choices=KINDS)
    tiny.add_argument("out_dir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--size",
        choices=SIZES,
        default="tiny",
        help=f"full: the published model sizes with random bf16 weights ({', '.join(FULL_KINDS)} "
        "only; glm-image ~34 GB, qwen3-omni ~70 GB, qwen-image ~58 GB, flux ~34 GB; built on the "
        "GPU when one is present)",
    )
    tiny.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="with --size full: depth of every stack (AR, vision, DiT, text encoders), widths "
        "unchanged; for testing the full-size code path on a small machine",
    )
    tiny.set_defaults(func=_make_tiny_model)

    lora = sub.add_parser(
        "make-tiny-lora",
        help="write a random LoRA adapter for a checkpoint's transformer (diffusers' format; "
        "Wan2.2 with two experts: also transformer_2/ for the low-noise expert)",
    )
    lora.add_argument("model_dir", help="the diffusers checkpoint folder the adapter is for")
    lora.add_argument("out_dir", help="the adapter folder to write (its name is the adapter's)")
    lora.add_argument("--rank", type=int, default=4)
    lora.add_argument("--seed", type=int, default=0)
    lora.set_defaults(func=_make_tiny_lora)

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
