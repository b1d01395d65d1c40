"""Fuzzing every route we add, from the server's own OpenAPI.

Library: hypothesis-jsonschema (on Hypothesis). Why it and not schemathesis: our routes read
their bodies by hand (size limit first, then strict validation), so the part worth fuzzing is
the request body, and hypothesis-jsonschema turns exactly the schema our server publishes for
it into a Hypothesis strategy, which we mix with near-misses (one field of the wrong type, a
required field dropped, unknown fields) and with raw garbage. It is small (Hypothesis plus
jsonschema, already here) and drives no HTTP itself: requests go through real HTTP to a real
server, and after each one we read a stage-side counter. schemathesis would bring its own
runner, HTTP stack and a large dependency tree for the same generation.

What "our routes" are is not listed here: the endpoint plugin attaches its routers to a bare
FastAPI app and every (method, path) it adds is fuzzed, so a route added later is covered. The
body schema of each comes from the running server's /openapi.json (routes without a JSON body
get garbage bodies and fuzzed path/query parameters).

Properties, for every generated request: no 5xx; every 4xx is OpenAI-shaped
(`{"error": {"message": str, "type": str, "param", "code"}}`); and no request reaches a stage
unless it was valid: the stages' own count of Submits (their answer on the guarded
`GET /v1/omni/stages?live=1`) grows by one exactly when a generation is answered 200, and not
at all otherwise. Bounded: a fixed number of examples per route and a wall-clock budget, on a
Qwen-Image server whose limits make any valid request cheap (<= 128x128, <= 4 steps, n <= 2).
"""

from __future__ import annotations

import json
import time
import urllib.parse
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from omni_server import API_KEY

pytestmark = pytest.mark.slow
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# Examples and wall-clock budget per route (examples past the budget are not sent, so CI stays
# bounded on a slow machine): the generation route, the one that can reach a stage, gets most.
EXAMPLES = {"generates": 60, "other": 15}
BUDGET_S = {"generates": 20.0, "other": 3.0}
MIN_EXAMPLES = 5  # sent whatever the budget (a loaded machine must not make the test vacuous)
# URL text: any character a client can encode (no lone surrogates).
URL_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
# A path parameter: no "/" either, which would address another path (vLLM's own 404).
PATH_TEXT = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="/"), max_size=40)
PATH_TEXT = PATH_TEXT.filter(lambda v: v not in ("", ".", ".."))

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


def our_routes() -> list[tuple[str, str]]:
    """(method, path) of every route the endpoint plugin attaches to vLLM's app."""
    from argparse import Namespace

    from fastapi import FastAPI
    from fastapi.routing import APIRoute

    from entry_points.endpoints import make_plugin

    app = FastAPI()
    app.state.args = Namespace(stage_config="any")  # routes attach in stage-config mode only
    make_plugin().attach_router(app)
    found = {
        (method, r.path)
        for r in app.routes
        if isinstance(r, APIRoute)
        for method in r.methods
        if method not in ("HEAD", "OPTIONS")
    }
    return sorted(found)


def json_body_schema(openapi: dict, method: str, path: str) -> dict | None:
    op = openapi["paths"].get(path, {}).get(method.lower(), {})
    content = op.get("requestBody", {}).get("content", {})
    schema = content.get("application/json", {}).get("schema")
    if schema is None:
        return None
    return {**schema, "components": openapi.get("components", {})}


def near_misses(schema: dict) -> st.SearchStrategy[Any]:
    """Schema-valid objects with one thing wrong: a field of another JSON type, a required
    field gone, or extra unknown fields."""
    valid = from_schema(schema)
    props = sorted(schema.get("properties", {}))
    required = list(schema.get("required", []))

    @st.composite
    def miss(draw) -> dict:
        obj = dict(draw(valid))
        how = draw(st.sampled_from(["retype", "extra"] + (["drop"] if required else [])))
        if how == "retype" and props:
            obj[draw(st.sampled_from(props))] = draw(JSON)
        elif how == "drop":
            obj.pop(draw(st.sampled_from(required)), None)
        else:
            obj.update(draw(st.dictionaries(st.text(min_size=1, max_size=12), JSON, max_size=3)))
        return obj

    return miss()


def body_strategy(schema: dict | None) -> st.SearchStrategy[bytes]:
    garbage = st.one_of(
        st.binary(max_size=64),
        JSON.map(lambda v: json.dumps(v).encode()),
    )
    if schema is None:
        return garbage
    objects = st.one_of(from_schema(schema), near_misses(schema)).map(
        lambda v: json.dumps(v).encode()
    )
    return st.one_of(objects, objects, objects, garbage)  # mostly objects: 3 to 1


def stage_submits(server) -> int:
    r = httpx.get(f"{server.url}/v1/omni/stages", params={"live": "1"}, headers=HEADERS, timeout=60)
    r.raise_for_status()
    lives = [s["live"] for s in r.json()["stages"]]
    assert all(x is not None for x in lives), lives
    return sum(x["submitted"] for x in lives)


def assert_openai_error(r: httpx.Response) -> None:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError(f"{r.status_code} not OpenAI-shaped: {r.text[:300]}") from None
    assert isinstance(err, dict), err
    assert isinstance(err.get("message"), str) and err["message"], err
    assert isinstance(err.get("type"), str) and err["type"], err
    assert "param" in err and "code" in err, err


def fill_path(path: str, value: str) -> str:
    """Every {param} of the path replaced by `value` (URL-quoted, so it stays one segment)."""
    out, rest = "", path
    while "{" in rest:
        head, _, tail = rest.partition("{")
        _, _, rest = tail.partition("}")
        out += head + urllib.parse.quote(value, safe="")
    return out + rest


@pytest.fixture(scope="module")
def fuzz_target(small_qwen_server):
    openapi = httpx.get(f"{small_qwen_server.url}/openapi.json", timeout=30).json()
    return small_qwen_server, openapi


@pytest.mark.parametrize(("method", "path"), our_routes())
def test_fuzz_route(fuzz_target, method, path):
    server, openapi = fuzz_target
    assert path in openapi["paths"], f"{method} {path} is missing from /openapi.json"
    schema = json_body_schema(openapi, method, path)
    generates = method == "POST" and path == "/v1/images/generations"
    # The image route must publish its body schema, or there is nothing to generate from.
    assert schema is not None or not generates
    kind = "generates" if generates else "other"
    seen: dict[int, int] = {}
    # Failures are collected rather than raised inside the example: a replay (shrinking) past
    # the time budget would not send the request again and look flaky to Hypothesis.
    failures: list[str] = []
    started = time.monotonic()
    submits_at_start = stage_submits(server)

    @settings(
        max_examples=EXAMPLES[kind],
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        body=body_strategy(schema) if method in ("POST", "PUT", "PATCH") else st.just(b""),
        param=PATH_TEXT,
        query=st.dictionaries(st.sampled_from(["live", "limit", "after", "x"]), URL_TEXT),
    )
    def one(body: bytes, param: str, query: dict[str, str]) -> None:
        if sum(seen.values()) >= MIN_EXAMPLES and time.monotonic() - started > BUDGET_S[kind]:
            return  # the budget is spent: later examples are not sent
        # Generations: the stages' Submit count around each request (the one route that
        # may reach a stage); other routes: once for the whole run, below.
        before = stage_submits(server) if generates else 0
        r = httpx.request(
            method,
            f"{server.url}{fill_path(path, param)}",
            params=query,
            content=body or None,
            headers={**HEADERS, "content-type": "application/json"},
            timeout=120,
        )
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        note = f"{method} {path} {param=} {body[:200]!r} -> {r.status_code} {r.text[:300]}"
        if r.status_code >= 500:
            failures.append(f"5xx: {note}")
        elif r.status_code >= 400:
            try:
                assert_openai_error(r)
            except AssertionError as exc:
                failures.append(f"not OpenAI-shaped ({exc}): {note}")
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            if "event: error" in r.text:  # a valid request failed inside a stage
                failures.append(f"stream error: {note}")
        if generates:
            reached = stage_submits(server) - before
            if reached != (1 if r.status_code == 200 else 0):
                failures.append(f"{reached} stage submit(s) for: {note}")

    one()
    assert sum(seen.values()) >= MIN_EXAMPLES, seen
    assert not failures, f"{len(failures)} failing of {sum(seen.values())}:\n" + "\n".join(
        failures[:8]
    )
    if not generates:  # nothing this route answered may have reached a stage
        assert stage_submits(server) == submits_at_start, seen


# ---- Multipart and chunked bodies ----------------------------------------------------------
FORM_NAMES = [
    "image",
    "image[]",
    "mask",
    "prompt",
    "n",
    "size",
    "seed",
    "stream",
    "input_reference",
    "model",
    "response_format",
    "num_inference_steps",
    "x",
]


def _png(width: int, height: int, mode: str) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new(mode, (width, height)).save(out, format="PNG")
    return out.getvalue()


FILE_BYTES = st.one_of(
    st.binary(max_size=256),
    st.builds(_png, st.integers(1, 96), st.integers(1, 96), st.sampled_from(["RGB", "RGBA", "L"])),
)
FORM_PART = st.tuples(
    st.sampled_from(FORM_NAMES),
    st.one_of(st.text(max_size=20).map(str.encode), FILE_BYTES),
    st.booleans(),  # as a file part
)


def multipart(parts: list[tuple[str, bytes, bool]], boundary: str, truncate: int | None) -> bytes:
    out = b""
    for name, value, is_file in parts:
        out += f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"'.encode()
        out += b'; filename="f.png"\r\nContent-Type: image/png' if is_file else b""
        out += b"\r\n\r\n" + value + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return out if truncate is None else out[:truncate]


def chunks(body: bytes, size: int):
    for i in range(0, len(body), size):
        yield body[i : i + size]


POST_ROUTES = [path for method, path in our_routes() if method == "POST"]


@pytest.mark.parametrize("path", POST_ROUTES)
def test_fuzz_multipart_and_chunked_bodies(fuzz_target, path):
    """Multipart forms (valid and broken, files and fields of every name the routes know, real
    and garbage images) and chunked bodies to every POST route: no 5xx, every 4xx OpenAI-shaped,
    and a stage sees exactly the requests answered 200."""
    server, _ = fuzz_target
    failures: list[str] = []
    seen: dict[int, int] = {}
    started = time.monotonic()

    @settings(
        max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(
        parts=st.lists(FORM_PART, max_size=5),
        boundary=st.sampled_from(["b", "xYz-123", "=="]),
        truncate=st.one_of(st.none(), st.integers(0, 200)),
        chunked=st.booleans(),
        chunk=st.integers(1, 64),
        as_form=st.booleans(),
        raw=body_strategy(None),
    )
    def one(parts, boundary, truncate, chunked, chunk, as_form, raw) -> None:
        if (
            sum(seen.values()) >= MIN_EXAMPLES
            and time.monotonic() - started > BUDGET_S["other"] * 2
        ):
            return
        if as_form:
            body = multipart(parts, boundary, truncate)
            kind = f"multipart/form-data; boundary={boundary}"
        else:
            body, kind = raw, "application/json"
        before = stage_submits(server)
        r = httpx.post(
            f"{server.url}{path}",
            content=chunks(body, chunk) if chunked else body,
            headers={**HEADERS, "content-type": kind},
            timeout=120,
        )
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        note = (
            f"POST {path} {kind} chunked={chunked} {body[:200]!r} -> {r.status_code} {r.text[:300]}"
        )
        if r.status_code >= 500:
            failures.append(f"5xx: {note}")
        elif r.status_code >= 400:
            try:
                assert_openai_error(r)
            except AssertionError as exc:
                failures.append(f"not OpenAI-shaped ({exc}): {note}")
        reached = stage_submits(server) - before
        if reached != (1 if r.status_code == 200 else 0):
            failures.append(f"{reached} stage submit(s) for: {note}")

    one()
    assert sum(seen.values()) >= MIN_EXAMPLES, seen
    assert not failures, f"{len(failures)} failing of {sum(seen.values())}:\n" + "\n".join(
        failures[:8]
    )
