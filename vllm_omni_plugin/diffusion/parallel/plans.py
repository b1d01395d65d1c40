"""What rank 0 tells its follower ranks, as msgspec structs in msgpack (no pickle).

A follower gets a RankInit (its engine config) before any StepPlan, then one StepPlan per step,
then Stop. A StepPlan's new requests carry everything a GenerationRequest holds: scalars as
they are, the prior token ids as raw tensor bytes, edit images and masks as lossless PNGs
(exactly the pixels rank 0 holds).
"""

from __future__ import annotations

import io
from typing import Any

import msgspec
import torch

from ...common.payload import InlineTensor
from ..config import DiffusionEngineConfig
from ..request import GenerationRequest


class RankInit(msgspec.Struct, tag=True):
    """What a follower needs to (re)build its engine (its rank is in its argv)."""

    config: DiffusionEngineConfig
    store_port: int | None  # rank 0's store; None: the process group exists already (a rebuild)


class PlannedRequest(msgspec.Struct):
    """A GenerationRequest on the pipe (see `to_plan` / `from_plan`)."""

    request_id: str
    prompt: str
    negative_prompt: str | None
    n: int
    height: int | None
    width: int | None
    num_inference_steps: int | None
    guidance_scale: float | None
    seed: int | None
    prior_token_ids: InlineTensor | None
    partial_images: int
    num_frames: int | None
    input_images: list[bytes]  # lossless PNGs
    mask: bytes | None  # lossless PNG


class StepPlan(msgspec.Struct, tag=True):
    new: list[tuple[PlannedRequest, int, bool]] = []  # request, seed, cfg
    prefill: list[str] = []
    denoise: list[tuple[str, int]] = []  # request id, step index
    live: set[str] = set()


class Stop(msgspec.Struct, tag=True):
    pass


RankMessage = RankInit | StepPlan | Stop

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RankMessage)


def encode(msg: RankMessage) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> RankMessage:
    return _decoder.decode(data)


def to_plan(req: GenerationRequest) -> PlannedRequest:
    return PlannedRequest(
        request_id=req.request_id,
        prompt=req.prompt,
        negative_prompt=req.negative_prompt,
        n=req.n,
        height=req.height,
        width=req.width,
        num_inference_steps=req.num_inference_steps,
        guidance_scale=req.guidance_scale,
        seed=req.seed,
        prior_token_ids=None if req.prior_token_ids is None else _tensor(req.prior_token_ids),
        partial_images=req.partial_images,
        num_frames=req.num_frames,
        input_images=[_png(im) for im in req.input_images],
        mask=None if req.mask is None else _png(req.mask),
    )


def from_plan(p: PlannedRequest) -> GenerationRequest:
    return GenerationRequest(
        request_id=p.request_id,
        prompt=p.prompt,
        negative_prompt=p.negative_prompt,
        n=p.n,
        height=p.height,
        width=p.width,
        num_inference_steps=p.num_inference_steps,
        guidance_scale=p.guidance_scale,
        seed=p.seed,
        prior_token_ids=None if p.prior_token_ids is None else _untensor(p.prior_token_ids),
        partial_images=p.partial_images,
        num_frames=p.num_frames,
        input_images=[_unpng(b) for b in p.input_images],
        mask=None if p.mask is None else _unpng(p.mask),
    )


def _tensor(t: torch.Tensor) -> InlineTensor:
    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return InlineTensor(str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)


def _untensor(v: InlineTensor) -> torch.Tensor:
    dtype = getattr(torch, v.dtype)
    if not v.data:
        return torch.empty(v.shape, dtype=dtype)
    return torch.frombuffer(bytearray(v.data), dtype=torch.uint8).view(dtype).reshape(v.shape)


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def _unpng(data: bytes) -> Any:
    from PIL import Image

    image = Image.open(io.BytesIO(data), formats=["PNG"])
    image.load()
    return image
