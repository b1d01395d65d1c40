"""HTTP client run inside a network namespace by the tests (`ip netns exec NS python ...`).

    ns_client.py status URL                    -> {"status": 200}
    ns_client.py generate BASE_URL MODEL SEED  -> {"png": [w, h], "sha": ...}  (openai client)
    ns_client.py metrics BASE_URL              -> {"text": "..."}
Prints one JSON line.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import sys

import httpx


def main(argv: list[str]) -> dict:
    cmd = argv[0]
    if cmd == "status":
        try:
            return {"status": httpx.get(argv[1], timeout=5).status_code}
        except httpx.HTTPError as exc:
            return {"status": None, "error": repr(exc)}
    if cmd == "metrics":
        return {"text": httpx.get(f"{argv[1]}/metrics", timeout=10).text}
    if cmd == "generate":
        from openai import OpenAI
        from PIL import Image

        client = OpenAI(base_url=f"{argv[1]}/v1", api_key="unused", timeout=300, max_retries=0)
        resp = client.images.generate(
            model=argv[2],
            prompt="a lighthouse on a cliff",
            size="64x64",
            response_format="b64_json",
            extra_body={"seed": int(argv[3])},
        )
        data = base64.b64decode(resp.data[0].b64_json)
        image = Image.open(io.BytesIO(data))
        return {
            "png": list(image.size),
            "format": image.format,
            "sha": hashlib.sha256(data).hexdigest(),
        }
    raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
