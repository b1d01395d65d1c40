"""HTTP client run inside a network namespace by the tests (`ip netns exec NS python ...`).

    ns_client.py status URL                    -> {"status": 200}
    ns_client.py wait URL TIMEOUT              -> {"status": 200}: polls URL until it answers 200
                                                  (or TIMEOUT s pass: the last status)
    ns_client.py generate BASE_URL MODEL SEED  -> {"png": [w, h], "sha": ...}  (openai client)
    ns_client.py metrics BASE_URL              -> {"text": "..."}
    ns_client.py speech BASE_URL MODEL MAX_TOKENS [MARK]
        -> {"pcm_sha", "pcm", "samples", "transcript", "audio_deltas", "error"}: a streamed
           Qwen3-Omni answer (pcm16, greedy; "pcm" in base64) through the openai client; with
           MARK, the file is created at the first audio delta and the rest is read slowly (a
           client the stream waits for)
    ns_client.py speech-image BASE_URL MODEL MAX_TOKENS
        -> the same, for a question about a small seeded RGB image (a PNG data URL part)
    ns_client.py chat BASE_URL MODEL MAX_TOKENS   -> {"text", "error"}: a text-only answer
           (greedy, not streamed) through the openai client
Prints one JSON line.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import sys
import time
from pathlib import Path

import httpx


def main(argv: list[str]) -> dict:
    cmd = argv[0]
    if cmd == "status":
        try:
            return {"status": httpx.get(argv[1], timeout=5).status_code}
        except httpx.HTTPError as exc:
            return {"status": None, "error": repr(exc)}
    if cmd == "wait":
        return wait_ok(argv[1], float(argv[2]))
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
    if cmd == "speech":
        return speech(argv[1], argv[2], int(argv[3]), argv[4] if len(argv) > 4 else None)
    if cmd == "speech-image":
        return speech(argv[1], argv[2], int(argv[3]), None, content=image_question())
    if cmd == "chat":
        return chat(argv[1], argv[2], int(argv[3]))
    raise SystemExit(f"unknown command {cmd!r}")


def wait_ok(url: str, timeout: float) -> dict:
    """One process polls for the whole wait: no interpreter start per poll."""
    deadline = time.monotonic() + timeout
    last: dict = {"status": None}
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            try:
                last = {"status": client.get(url).status_code}
            except httpx.HTTPError as exc:
                last = {"status": None, "error": repr(exc)}
            if last["status"] == 200:
                break
            time.sleep(0.5)
    return last


def image_question() -> list[dict]:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(png, "PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    return [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]


def speech(
    url: str, model: str, max_tokens: int, mark: str | None, content: str | list = "Say hi"
) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)
    pcm, transcript, deltas, error = b"", "", 0, None
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            temperature=0,
            max_tokens=max_tokens,
            stream=True,
            modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "pcm16"},
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if not chunk.choices:
                continue
            audio = getattr(chunk.choices[0].delta, "audio", None)
            if audio is None:
                continue
            audio = audio if isinstance(audio, dict) else audio.model_dump()
            transcript += audio.get("transcript") or ""
            if audio.get("data"):
                pcm += base64.b64decode(audio["data"])
                deltas += 1
                if mark is not None:
                    Path(mark).touch()
                    time.sleep(0.5)  # a slow reader: the pipeline waits on its credits
    except openai.APIError as exc:
        error = {"message": exc.message, "body": exc.body}
    return {
        "pcm_sha": hashlib.sha256(pcm).hexdigest(),
        "pcm": base64.b64encode(pcm).decode(),
        "samples": len(pcm) // 2,
        "transcript": transcript,
        "audio_deltas": deltas,
        "error": error,
    }


def chat(url: str, model: str, max_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)
    try:
        answer = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say hi"}],
            temperature=0,
            max_tokens=max_tokens,
            extra_body={"ignore_eos": True},
        )
    except openai.APIError as exc:
        return {"text": None, "error": {"message": exc.message, "body": exc.body}}
    return {"text": answer.choices[0].message.content, "error": None}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
