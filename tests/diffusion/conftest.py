"""Fixtures for the diffusion engine tests: engines and diffusers references on tiny models."""

from __future__ import annotations

import pytest
from family_helpers import mean_abs_diff


@pytest.fixture(scope="session")
def pixel_diff():
    return mean_abs_diff


def run_staggered(engine, first, later, join_after_steps: int = 1):
    """Add `first`, run `join_after_steps` engine steps, add `later`, run to completion.

    Returns outputs by request id and the largest denoising batch seen, so tests can check
    that requests really shared forwards while joining at different steps.
    """
    results = {}
    for r in first:
        engine.add_request(r)
    for _ in range(join_after_steps):
        for o in engine.step():
            results[o.request_id] = o
    for r in later:
        engine.add_request(r)
    while engine.has_unfinished():
        for o in engine.step():
            results[o.request_id] = o
    return results


@pytest.fixture(scope="session")
def staggered():
    return run_staggered
