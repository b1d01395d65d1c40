"""Which request fields each route takes, per model family: the one table every route checks.

A field in a request body is either applied (it reaches the code that uses it, its type and
bounds checked here, before any stage) or refused with a 400 in OpenAI's error shape that names
it (`unknown_parameter`, or `invalid_value` / `invalid_type` for a bad value). Never accepted
and ignored.

The table has three parts:
- each route's common fields (`COMMON`: their JSON schemas; the generations/edits fields are
  the request model's, serving/protocol.py);
- each family's knobs (common/knobs.py's FAMILY_KNOBS, which its diffusion adapter declares as
  `DiffusionAdapter.knobs`), announced by the running stage (`FamilyFields.from_info`), and the
  common fields the family does not apply (`DiffusionAdapter.unsupported`);
- route-wide extensions (`EXTENSIONS`: a `RequestField` with its own check; its checked value
  reaches `ValidRequest.extensions` / the video request's "extensions" under its name, from
  where the field's owner carries it into `GenerationParams`), and the fields other servers'
  clients send that we refuse on purpose (`REFUSED`, with the reason).

The same table builds the routes' OpenAPI body schemas (`body_schema`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..common.knobs import FAMILY_KNOBS, CfgFacts, Knob, KnobError, unused_field
from . import lora_adapters
from .errors import APIError, invalid
from .protocol import ImageGenerationRequest

GENERATIONS, EDITS, VIDEOS = "generations", "edits", "videos"
ROUTES = (GENERATIONS, EDITS, VIDEOS)
ROUTE_PATHS = {
    GENERATIONS: "POST /v1/images/generations",
    EDITS: "POST /v1/images/edits",
    VIDEOS: "POST /v1/videos and /v1/videos/sync",
}

_STR = {"type": "string"}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
_FILE = {"type": "string", "format": "binary"}

# Fields of POST /v1/images/edits beyond the generations model: the uploads (multipart files)
# and the source image by URL (`data:` URLs; http(s) only for `serving.edit_url_hosts`).
EDIT_ONLY: dict[str, dict[str, Any]] = {
    "image": {**_FILE, "description": "The source image (PNG, JPEG or WEBP)"},
    "image[]": {"type": "array", "items": _FILE, "description": "Several source images"},
    "mask": {**_FILE, "description": "PNG whose fully transparent pixels mark what to repaint"},
    "url": {
        **_STR,
        "description": "The source image as a data: URL (or an http(s) URL on a host the "
        "deploy file lists in serving.edit_url_hosts), instead of a file",
    },
    "url[]": {"type": "array", "items": _STR, "description": "Several source image URLs"},
}

VIDEO_FIELDS: dict[str, dict[str, Any]] = {
    "prompt": {**_STR, "description": "What the video shows"},
    "model": {**_STR, "description": "A served model name"},
    "size": {**_STR, "description": "WIDTHxHEIGHT; or give width and height"},
    "width": {**_INT, "description": "Frame width in pixels (with height, instead of size)"},
    "height": {**_INT, "description": "Frame height in pixels (with width, instead of size)"},
    "seconds": {
        "type": ["string", "integer"],
        "description": "Length in seconds (OpenAI's field): seconds x fps frames after the first",
    },
    "num_frames": {**_INT, "description": "Frames of the video: 1 + a multiple of the VAE step"},
    "fps": {**_INT, "description": "Frames per second of the MP4"},
    "seed": {**_INT, "description": "Seed of the request's generator"},
    "num_inference_steps": {**_INT, "description": "Denoising steps"},
    "guidance_scale": {**_NUM, "description": "CFG scale (CFG runs when > 1)"},
    "negative_prompt": {**_STR, "description": "What to steer away from (with CFG)"},
    "user": {**_STR, "description": "Your end user's id; logged with the job"},
    "input_reference": {
        **_FILE,
        "description": "Image-to-video models (Wan2.2 TI2V-5B, I2V-A14B): the source image "
        "(PNG, JPEG or WEBP; in JSON a data: URL), resized to the video's size; text-to-video "
        "models refuse it",
    },
}


def _generation_fields() -> dict[str, dict[str, Any]]:
    return dict(ImageGenerationRequest.model_json_schema()["properties"])


@dataclass(frozen=True)
class RequestField:
    """A route-wide field with its own check (not a family knob): `check(value)` returns the
    value to carry or raises APIError; `routes` are the routes that take it."""

    name: str
    routes: tuple[str, ...]
    schema: dict[str, Any]
    check: Callable[[Any], Any]


# Route-wide extensions, checked here and carried in ValidRequest.extensions: `lora` (LoRA
# adapters per request; serving/lora_adapters.py resolves the names before any stage).
EXTENSIONS: list[RequestField] = [
    RequestField("lora", ROUTES, lora_adapters.SCHEMA, lora_adapters.check_field),
]


def common_fields(route: str) -> dict[str, dict[str, Any]]:
    """name -> JSON schema of the fields every family takes on `route`."""
    if route == VIDEOS:
        out = dict(VIDEO_FIELDS)
    else:
        out = _generation_fields()
        if route == EDITS:
            out.update(EDIT_ONLY)
    for ext in EXTENSIONS:
        if route in ext.routes:
            out[ext.name] = ext.schema
    return out


# Fields other servers' clients send (vLLM-Omni's extensions, OpenAI's fields for its own
# models) that no family here applies -> why they are refused (docs/migrating-from-vllm-omni.md lists them too).
REFUSED: dict[str, str] = {
    "layers": "layered output (Qwen-Image-Layered) is not served",
    "resolution": "layered output (Qwen-Image-Layered) is not served",
    "vae_use_slicing": "VAE slicing is a stage setting (vae_use_slicing in the deploy file), "
    "not a per-request choice",
    "vae_use_tiling": "VAE tiling is a stage setting (vae_use_tiling in the deploy file), "
    "not a per-request choice",
    "generator_device": "seeds always draw on a CPU generator (as diffusers' examples), so a "
    "seed gives the same image on every device",
    "extra_params": "opaque model arguments are not passed through: every knob a family "
    "applies is a named field (see /openapi.json)",
    "use_system_prompt": "no served family rewrites prompts with a system prompt",
    "system_prompt": "no served family rewrites prompts with a system prompt",
    "sys_type": "no served family rewrites prompts with a system prompt",
    "bot_task": "no served family has a chain-of-thought mode",
    "return_stage_metrics": "per-stage timings are always in the x-omni-stage-timings header",
    "strength": "no served edit family has an image-to-image strength",
    "mask_image": "send the mask as the 'mask' file (OpenAI's field)",
    "reference_image": "send reference images as the 'image' / 'image[]' files of "
    "POST /v1/images/edits (FLUX.2 klein)",
    "image_reference": "send the source image as 'input_reference' (OpenAI's field)",
    "video_reference": "video-to-video is not served",
    "audio_reference": "speech-to-video is not served",
    "input_references": "image-to-video takes one source image, as 'input_reference'",
    "video_params": "give width, height, num_frames and fps as top-level fields",
    "generate_sound": "no served video family makes sound",
    "sound_duration": "no served video family makes sound",
    "enable_frame_interpolation": "frame interpolation is not served",
    "frame_interpolation_exp": "frame interpolation is not served",
    "frame_interpolation_scale": "frame interpolation is not served",
    "frame_interpolation_model_path": "frame interpolation is not served",
    "style": "styles are a DALL-E 3 feature; no served family has them",
    "input_fidelity": "no served edit family has an input-fidelity setting",
    "remix_video_id": "video remixes are not served",
}


@dataclass(frozen=True)
class FamilyFields:
    """What the served model's family adds to and removes from the common fields."""

    family: str = ""
    knobs: tuple[Knob, ...] = ()
    unsupported: dict[str, str] = field(default_factory=dict)
    cfg: CfgFacts | None = None  # the family's CFG rule (None: none known)

    @classmethod
    def from_info(cls, info: Any) -> FamilyFields:
        """From the final stage's StageInfo ("family", "knobs", "unsupported", "cfg"); None:
        the stage has not announced itself yet."""
        if info is None:
            return cls()
        cfg = getattr(info, "cfg", None)
        return cls(
            family=str(getattr(info, "family", None) or getattr(info, "pipeline_class", "") or ""),
            knobs=tuple(Knob.from_dict(k) for k in getattr(info, "knobs", ())),
            unsupported=dict(getattr(info, "unsupported", {})),
            cfg=CfgFacts.from_dict(cfg) if cfg else None,
        )

    def check_used(self, given: dict[str, Any]) -> None:
        """Refuse a field `given` sets that the family's CFG rule leaves unread (a negative
        prompt without CFG, ...): 400 naming it, as the engine would refuse it."""
        unused = None if self.cfg is None else unused_field(self.cfg, given)
        if unused is not None:
            name, why = unused
            raise invalid(f"'{name}' {why}", name, "invalid_value")


def family_catalogue() -> dict[str, tuple[Knob, ...]]:
    """family name -> its knobs, for every built-in family (the "which families take it" hint
    and the OpenAPI bodies; the served family's own knobs come from its stage)."""
    return {fam: knobs for fam, knobs in FAMILY_KNOBS.items() if knobs}


def families_taking(name: str) -> list[str]:
    return sorted(
        fam for fam, knobs in family_catalogue().items() if name in {k.name for k in knobs}
    )


def split_fields(
    route: str, data: dict[str, Any], family: FamilyFields
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(common fields, family knobs checked, extensions checked) of a request body, or the
    400 that names the first field the route or family does not apply."""
    common = common_fields(route)
    knobs = {k.name: k for k in family.knobs}
    extensions = {e.name: e for e in EXTENSIONS if route in e.routes}
    out_common: dict[str, Any] = {}
    out_knobs: dict[str, Any] = {}
    out_ext: dict[str, Any] = {}
    for name in sorted(data, key=str):
        value = data[name]
        if name in family.unsupported:
            raise invalid(
                f"'{name}' is not applied by {family.family}: {family.unsupported[name]}",
                name,
                "unknown_parameter",
            )
        if name in extensions:
            out_ext[name] = extensions[name].check(value)
        elif name in common:
            out_common[name] = value
        elif name in knobs:
            try:
                out_knobs[name] = knobs[name].check(value)
            except KnobError as exc:
                raise invalid(exc.message, name, exc.code) from None
        else:
            raise refused(route, name, family)
    return out_common, out_knobs, out_ext


def refused(route: str, name: str, family: FamilyFields) -> APIError:
    """The 400 for a field `route` does not take for this family, saying why."""
    label = family.family or "this model"
    if name in REFUSED:
        why = REFUSED[name]
    elif takers := [f for f in families_taking(name) if f != family.family]:
        why = f"it is a knob of {', '.join(takers)}, not of {label}"
    elif others := [r for r in ROUTES if r != route and name in common_fields(r)]:
        why = f"{ROUTE_PATHS[others[0]]} takes it, {ROUTE_PATHS[route]} does not"
    else:
        why = f"{ROUTE_PATHS[route]} has no such field (see /openapi.json)"
    return invalid(f"unknown parameter '{name}': {why}", name, "unknown_parameter")


def body_schema(route: str) -> dict[str, Any]:
    """The route's JSON body schema: its common fields, then every family's knobs (each one's
    description says which families apply it; another family refuses it)."""
    props = dict(common_fields(route))
    takers: dict[str, list[str]] = {}
    knobs: dict[str, Knob] = {}
    for fam, fam_knobs in family_catalogue().items():
        for knob in fam_knobs:
            if knob.name not in props:
                knobs.setdefault(knob.name, knob)
                takers.setdefault(knob.name, []).append(fam)
    for name, knob in knobs.items():
        schema = knob.schema()
        schema["description"] = f"{knob.doc}. Only {', '.join(sorted(takers[name]))}."
        props[name] = schema
    return {"type": "object", "properties": props, "required": ["prompt"]}
