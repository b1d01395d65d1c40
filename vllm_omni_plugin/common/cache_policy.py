"""Step-cache policies as users choose them: names, parameters, bounds (a leaf module: pure
Python, imported by the config loader, the API server and the diffusion engine).

A request picks one with `{"cache": {"policy": "first_block", "threshold": 0.1}}`; the stage's
deploy file (`diffusion.step_cache`) sets which policies it allows, their bounds and the default a
request without `cache` gets. The config loader and the engine both validate through
`parse_cache` / `CacheBounds.check`, so a value refused at load is refused per request too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

NONE = "none"
FIRST_BLOCK = "first_block"
TEACACHE = "teacache"
TAYLORSEER = "taylorseer"
POLICIES = (NONE, FIRST_BLOCK, TEACACHE, TAYLORSEER)

# Parameters each policy takes, with their defaults (the method authors' / diffusers' defaults).
PARAMS: dict[str, dict[str, float | int]] = {
    NONE: {},
    # diffusers FirstBlockCacheConfig(threshold=0.05).
    FIRST_BLOCK: {"threshold": 0.05},
    # TeaCache4FLUX's README: 0.25 is its "1.5x, no visible loss" point.
    TEACACHE: {"threshold": 0.25},
    # diffusers TaylorSeerCacheConfig(cache_interval=5, disable_cache_before_step=3, max_order=1).
    TAYLORSEER: {"interval": 5, "warmup": 3, "order": 1},
}

# Hard limits every stage shares; a deploy file may narrow them (`max_threshold`, ...).
THRESHOLD_LIMIT = 10.0
INTERVAL_LIMIT = 100
WARMUP_LIMIT = 1000
ORDER_LIMIT = 4


class CachePolicyError(ValueError):
    """A bad policy or parameter; `field` names it the way the user wrote it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class CachePolicy:
    """One request's step-cache choice, validated and filled with defaults."""

    policy: str = NONE
    threshold: float = 0.0
    interval: int = 1
    warmup: int = 0
    order: int = 1

    @property
    def active(self) -> bool:
        """False where the policy computes every step (none, threshold 0, interval 1)."""
        if self.policy in (FIRST_BLOCK, TEACACHE):
            return self.threshold > 0
        if self.policy == TAYLORSEER:
            return self.interval > 1
        return False

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"policy": self.policy}
        out.update({k: getattr(self, k) for k in PARAMS[self.policy]})
        return out


def parse_cache(value: Any, where: str = "cache") -> CachePolicy:
    """A `cache` mapping as users send it -> CachePolicy (defaults filled). Raises
    CachePolicyError naming the field for an unknown policy or parameter, or a bad value."""
    if isinstance(value, CachePolicy):
        return value
    if not isinstance(value, dict):
        raise CachePolicyError(where, 'must be an object like {"policy": "first_block"}')
    name = value.get("policy")
    if name not in POLICIES:
        raise CachePolicyError(f"{where}.policy", f"{name!r} is not one of {list(POLICIES)}")
    params = dict(PARAMS[name])
    for key, raw in value.items():
        if key == "policy":
            continue
        if key not in params:
            allowed = sorted(params) or "no parameters"
            raise CachePolicyError(f"{where}.{key}", f"policy {name!r} takes {allowed}")
        params[key] = _number(f"{where}.{key}", raw, integer=key != "threshold")
    if "threshold" in params and not 0 <= params["threshold"] <= THRESHOLD_LIMIT:
        raise CachePolicyError(
            f"{where}.threshold", f"{params['threshold']} is outside [0, {THRESHOLD_LIMIT}]"
        )
    for key, lo, hi in (
        ("interval", 1, INTERVAL_LIMIT),
        ("warmup", 0, WARMUP_LIMIT),
        ("order", 0, ORDER_LIMIT),
    ):
        if key in params and not lo <= params[key] <= hi:
            raise CachePolicyError(f"{where}.{key}", f"{params[key]} is outside [{lo}, {hi}]")
    return CachePolicy(policy=name, **params)


def _number(field_name: str, raw: Any, integer: bool) -> float | int:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise CachePolicyError(field_name, "must be a number")
    if integer:
        if isinstance(raw, float) and not raw.is_integer():
            raise CachePolicyError(field_name, "must be an integer")
        return int(raw)
    if not math.isfinite(raw):
        raise CachePolicyError(field_name, "must be finite")
    return float(raw)


@dataclass(frozen=True)
class CacheBounds:
    """What a stage allows: its policies, the largest threshold, the default policy."""

    policies: tuple[str, ...] = (NONE,)
    max_threshold: float = THRESHOLD_LIMIT
    default: CachePolicy = field(default_factory=CachePolicy)

    def check(self, policy: CachePolicy, where: str = "cache") -> CachePolicy:
        if policy.policy not in self.policies:
            raise CachePolicyError(
                f"{where}.policy",
                f"{policy.policy!r} is not enabled on this stage (enabled: {list(self.policies)})",
            )
        if policy.policy in (FIRST_BLOCK, TEACACHE) and policy.threshold > self.max_threshold:
            raise CachePolicyError(
                f"{where}.threshold",
                f"{policy.threshold} exceeds this stage's max_threshold {self.max_threshold}",
            )
        return policy

    def resolve(self, value: Any) -> CachePolicy:
        """A request's `cache` value (None: the stage default) -> its checked policy."""
        if value is None:
            return self.default
        return self.check(parse_cache(value))
