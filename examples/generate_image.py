"""Generate an image from a running `vllm serve --stage-config ...` with the official openai client.

make serve                                  # terminal 1: tiny GLM-Image on port 8000
python examples/generate_image.py "a lighthouse at dusk" -o lighthouse.png
"""

from __future__ import annotations

import argparse
import base64

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("prompt", nargs="?", default="a lighthouse on a cliff at dusk")
    parser.add_argument("-o", "--output", default="image.png")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="EMPTY", help="the server's --api-key, if it has one")
    parser.add_argument("--size", default="64x64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="num_inference_steps")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id  # the served pipeline
    extra = {"seed": args.seed}
    if args.steps is not None:
        extra["num_inference_steps"] = args.steps
    result = client.images.generate(
        model=model,
        prompt=args.prompt,
        size=args.size,
        response_format="b64_json",
        extra_body=extra,
    )
    with open(args.output, "wb") as f:
        f.write(base64.b64decode(result.data[0].b64_json))
    print(f"wrote {args.output} ({args.size}, model {model})")


if __name__ == "__main__":
    main()
