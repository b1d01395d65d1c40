"""Run inside a network namespace (`ip netns exec NS python ns_load.py ...`): HTTP calls to a
server on that namespace's loopback; prints one JSON answer on its last line.

    ns_load.py generate URL MODEL N SEED0 STEPS   N concurrent requests through the official
                                            openai client, seeds SEED0..SEED0+N-1: status,
                                            sha, RGB pixels, times
    ns_load.py get URL                      status and text of a GET (/health, /metrics)
    ns_load.py wait_busy URL NODE TIMEOUT   polls /metrics until the replica on NODE holds a
                                            request (omni_replica_requests_in_flight > 0)
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def generate(url: str, model: str, n: int, seed0: int, steps: int) -> list[dict]:
    # Imported here: `get` and `wait_busy` run in polling loops, where openai and PIL made each
    # call cost a CPU-second (0.2 without).
    import openai
    from PIL import Image

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)

    def one(i: int) -> dict:
        t0 = time.time()
        try:
            out = client.images.generate(
                model=model,
                prompt=f"a red square, number {i}",
                size="64x64",
                extra_body={"seed": seed0 + i, "num_inference_steps": steps},
            )
            png = base64.b64decode(out.data[0].b64_json)
            pixels = list(Image.open(io.BytesIO(png)).convert("RGB").tobytes())
            return {
                "pixels": pixels,
                "i": i,
                "status": 200,
                "sha": hashlib.sha256(png).hexdigest(),
                "t0": t0,
                "t1": time.time(),
            }
        except openai.APIStatusError as exc:
            return {
                "i": i,
                "status": exc.status_code,
                "error": str(exc)[:300],
                "t0": t0,
                "t1": time.time(),
            }

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def wait_busy(url: str, node: str, timeout: float) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("omni_replica_requests_in_flight{") and f'node="{node}"' in line:
                if float(line.rsplit(" ", 1)[1]) > 0:
                    return {"busy": True, "line": line}
        time.sleep(0.05)
    return {"busy": False}


def main() -> None:
    cmd, url = sys.argv[1], sys.argv[2]
    if cmd == "generate":
        answer = generate(url, sys.argv[3], *map(int, sys.argv[4:7]))
    elif cmd == "wait_busy":
        answer = wait_busy(url, sys.argv[3], float(sys.argv[4]))
    else:
        try:
            r = httpx.get(url, timeout=10)
            answer = {"status": r.status_code, "text": r.text}
        except httpx.HTTPError as exc:
            answer = {"status": 0, "text": str(exc)}
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
