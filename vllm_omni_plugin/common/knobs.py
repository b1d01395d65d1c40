"""Request knobs a model family applies beyond the common fields (plain Python: no torch).

`FAMILY_KNOBS` is the table of the built-in families' knobs, under diffusers' names; each
family's adapter declares its own from it (`DiffusionAdapter.knobs`; another package's adapter
declares its own). A stage announces the knobs its loaded model applies in its StageInfo, and
the API server checks a request's values against them (type and bounds) before any stage sees
it; the engine checks them again. `CfgFacts` is a family's CFG rule, announced the same way.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

KINDS = ("number", "integer", "boolean", "string")


class KnobError(ValueError):
    """A knob's value is refused; `code` is OpenAI's error code for it."""

    def __init__(self, name: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.name = name
        self.message = message
        self.code = code


@dataclass(frozen=True)
class Knob:
    """One request field a family applies, under the name diffusers' pipeline gives it."""

    name: str  # the request field (diffusers' __call__ argument or pipeline config name)
    kind: str  # JSON type: "number", "integer", "boolean" or "string"
    doc: str  # one line for the OpenAPI schema and the docs
    minimum: float | None = None  # inclusive
    maximum: float | None = None  # inclusive

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"knob {self.name}: kind must be one of {KINDS}, got {self.kind!r}")

    def check(self, value: Any) -> Any:
        """The value as the stage receives it (an int stays an int), or KnobError."""
        if self.kind == "boolean":
            if not isinstance(value, bool):
                raise KnobError(self.name, f"'{self.name}' must be true or false", "invalid_type")
            return value
        if self.kind == "string":
            if not isinstance(value, str):
                raise KnobError(self.name, f"'{self.name}' must be a string", "invalid_type")
            return value
        numeric = (int,) if self.kind == "integer" else (int, float)
        if isinstance(value, bool) or not isinstance(value, numeric):
            kind = "an integer" if self.kind == "integer" else "a number"
            raise KnobError(self.name, f"'{self.name}' must be {kind}", "invalid_type")
        if not math.isfinite(value):
            raise KnobError(self.name, f"'{self.name}' must be finite")
        lo, hi = self.minimum, self.maximum
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise KnobError(
                self.name,
                f"'{self.name}' must be in [{_fmt(lo, '-inf')}, {_fmt(hi, 'inf')}], got {value}",
            )
        return float(value) if self.kind == "number" else value

    def schema(self) -> dict[str, Any]:
        """The knob's JSON schema (the routes' OpenAPI bodies)."""
        out: dict[str, Any] = {"type": self.kind, "description": self.doc}
        if self.minimum is not None:
            out["minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain values for the Ready info (every link encodes them)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Knob:
        return cls(**data)


def check_knobs(declared: tuple[Knob, ...], values: dict[str, Any]) -> dict[str, Any]:
    """`values` checked against the declared knobs; an undeclared one is refused (KnobError)."""
    by_name = {k.name: k for k in declared}
    out = {}
    for name, value in values.items():
        knob = by_name.get(name)
        if knob is None:
            raise KnobError(name, f"'{name}' is not a knob of this model", "unknown_parameter")
        out[name] = knob.check(value)
    return out


def _fmt(bound: float | None, unbounded: str) -> str:
    return unbounded if bound is None else f"{bound:g}"


@dataclass(frozen=True)
class CfgFacts:
    """How a family decides on classifier-free guidance (diffusers' rule), as plain data: the
    stage announces it, and the API server and the engine refuse with it the fields a request
    sets that the model would not use (`unused_field`)."""

    scale_field: str  # the request field holding the CFG scale ("guidance_scale" or a knob)
    default_scale: float  # that scale when the request sets none (the stage's default)
    needs_negative: bool  # true CFG (Qwen-Image, FLUX): on only with a negative prompt
    default_negative: bool  # the stage has a default negative prompt
    guidance_used: bool  # guidance_scale is applied at all (see `unused_field`)
    second_scale: str | None = None  # a second CFG scale knob (Wan2.2's guidance_scale_2)
    # The model's switch to the expert second_scale guides, as a fraction of the training
    # timesteps (Wan2.2's boundary_ratio; a request's boundary_ratio replaces it).
    second_boundary: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CfgFacts:
        return cls(**data)


def unused_field(facts: CfgFacts, given: dict[str, Any]) -> tuple[str, str] | None:
    """(field, why) of a field the request set (`given`: the request's own fields and knobs,
    None for unset) that this model would not use, or None."""
    # True-CFG families (Qwen-Image, Qwen-Image-Edit, FLUX) read guidance_scale only as the
    # embedded guidance of a guidance-distilled transformer (`guidance_embeds`): diffusers'
    # QwenImagePipeline and FluxPipeline otherwise drop it with a warning and take the CFG
    # scale from true_cfg_scale alone (default 4.0 for Qwen-Image, even when guidance_scale is
    # given), and vLLM-Omni does the same. So such a model refuses it (`guidance_used` False)
    # rather than read it as the CFG scale: the same request gives diffusers' image.
    if given.get("guidance_scale") is not None and not facts.guidance_used:
        return "guidance_scale", (
            "this model is not guidance-distilled: diffusers ignores guidance_scale; use "
            f"{facts.scale_field} with a negative_prompt"
        )
    scale = given.get(facts.scale_field)
    scale = facts.default_scale if scale is None else scale
    negative = given.get("negative_prompt") is not None or facts.default_negative
    rule = f"CFG runs when {facts.scale_field} > 1"
    if facts.needs_negative:
        rule += " and a negative_prompt is given"
        if given.get(facts.scale_field) is not None and not negative:
            return facts.scale_field, f"has no effect without a negative_prompt ({rule})"
    cfg_on = scale > 1 and (negative or not facts.needs_negative)
    if given.get("negative_prompt") is not None and not cfg_on:
        return "negative_prompt", f"has no effect: this request runs no CFG ({rule}: {scale:g})"
    second = facts.second_scale
    if second is not None and given.get(second) is not None and not cfg_on:
        return second, f"has no effect: this request runs no CFG ({rule}: {scale:g})"
    if second is not None and given.get(second) is not None:
        # diffusers' WanPipeline runs the second expert (guided by guidance_scale_2) at the
        # steps whose timestep t < boundary_ratio * num_train_timesteps: none when it is 0.
        ratio = given.get("boundary_ratio")
        ratio = facts.second_boundary if ratio is None else ratio
        if ratio is not None and ratio <= 0:
            return second, (
                "has no effect: with boundary_ratio 0 no step runs the low-noise expert, the "
                f"only one {second} guides"
            )
    return None


# diffusers pipelines whose CFG scale is true_cfg_scale and whose guidance_scale is read only by
# a guidance-distilled transformer (`guidance_embeds`): a Qwen-Image stage's default
# guidance_scale stands in for its true_cfg_scale on other checkpoints (see below).
QWEN_IMAGE_PIPELINES = ("QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline")


def ignored_guidance_default(defaults: dict[str, Any], guidance_distilled: bool) -> str | None:
    """Why a Qwen-Image stage's default guidance_scale (`defaults`: its default_sampling_params)
    would go unread, or None. Without embedded guidance the stage reads it as its true CFG
    scale, but only while true_cfg_scale is unset: with both, diffusers (and the stage) take
    true_cfg_scale and ignore guidance_scale."""
    if guidance_distilled or None in (
        defaults.get("guidance_scale"),
        defaults.get("true_cfg_scale"),
    ):
        return None
    return (
        "is ignored: this transformer is not guidance-distilled (guidance_embeds false), so "
        "true_cfg_scale is the CFG scale and diffusers ignores guidance_scale; remove it (or "
        "set only guidance_scale, which then serves as true_cfg_scale)"
    )


def cfg_runs(facts: CfgFacts | None, given: dict[str, Any]) -> bool:
    """Whether a request setting `given` (None for unset) runs CFG by the family's rule; no rule
    known: True (the larger memory estimate)."""
    if facts is None:
        return True
    scale = given.get(facts.scale_field)
    scale = facts.default_scale if scale is None else scale
    negative = given.get("negative_prompt") is not None or facts.default_negative
    return scale > 1 and (negative or not facts.needs_negative)


# ---- the built-in families' knobs --------------------------------------------------------------
TRUE_CFG_SCALE = Knob(
    "true_cfg_scale",
    "number",
    "True classifier-free guidance scale (diffusers' true_cfg_scale): on when > 1 and a "
    "negative_prompt is given",
    0.0,
    100.0,
)
GUIDANCE_SCALE_2 = Knob(
    "guidance_scale_2",
    "number",
    "Wan2.2: CFG scale of the low-noise expert (default: guidance_scale)",
    0.0,
    100.0,
)
BOUNDARY_RATIO = Knob(
    "boundary_ratio",
    "number",
    "Wan2.2: the expert switch, as a fraction of the training timesteps (default: the model's)",
    0.0,
    1.0,
)
FLOW_SHIFT = Knob(
    "flow_shift",
    "number",
    "The flow-matching scheduler's sigma shift (default: the model's scheduler config)",
    0.1,
    100.0,
)
# family (the adapter's `family`) -> its knobs
FAMILY_KNOBS: dict[str, tuple[Knob, ...]] = {
    "Qwen-Image": (TRUE_CFG_SCALE,),
    "Qwen-Image-Edit": (TRUE_CFG_SCALE,),
    "FLUX": (TRUE_CFG_SCALE,),
    "FLUX.1-Kontext": (TRUE_CFG_SCALE,),
    "Qwen-Image-Edit-Plus": (TRUE_CFG_SCALE,),
    "Wan2.2": (GUIDANCE_SCALE_2, BOUNDARY_RATIO, FLOW_SHIFT),
    "GLM-Image": (),
    "Z-Image": (),
    "FLUX.2-klein": (),
}
