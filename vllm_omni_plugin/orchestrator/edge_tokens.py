"""A Submit's streamed-edge tokens on the node link: masked under the link's key.

A streamed edge's token is the key of its channel between nodes (connectors/edge_channel.py):
whoever holds it can speak for the request's producer or consumer. The node link authenticates
its messages but does not encrypt them, so the head sends a remote stage's Submit with each
token XORed with a pad drawn from the shared key and a fresh nonce (carried in the ToStage),
and the node takes the pad off before its stage sees the Submit. Someone reading the link
learns the nonce and the masked tokens, and nothing of the tokens without the key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import msgspec

from ..common.messages import Submit

NONCE_BYTES = 16
MAX_TOKEN_BYTES = 64  # the orchestrator's are 32 hex characters


def _pad(key: bytes, nonce: bytes, label: str, size: int) -> bytes:
    if size > MAX_TOKEN_BYTES:
        raise ValueError(f"a {size}-byte edge token (at most {MAX_TOKEN_BYTES})")
    out = b""
    block = 0
    while len(out) < size:
        material = b"omni-edge-token/1\0" + nonce + label.encode() + bytes([block])
        out += hmac.new(key, material, hashlib.sha256).digest()
        block += 1
    return out[:size]


def _mask(key: bytes, nonce: bytes, label: str, token: str) -> str:
    data = token.encode()
    return bytes(a ^ b for a, b in zip(data, _pad(key, nonce, label, len(data)), strict=True)).hex()


def _unmask(key: bytes, nonce: bytes, label: str, masked: str) -> str:
    data = bytes.fromhex(masked)
    return bytes(
        a ^ b for a, b in zip(data, _pad(key, nonce, label, len(data)), strict=True)
    ).decode()


def has_tokens(msg: Submit) -> bool:
    return bool(msg.stream_token or msg.stream_tokens)


def mask_tokens(msg: Submit, key: bytes) -> tuple[Submit, bytes]:
    """The Submit as it goes on the link, and the nonce its tokens are masked under."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    masked = msgspec.structs.replace(
        msg,
        stream_token=_mask(key, nonce, "out", msg.stream_token) if msg.stream_token else "",
        stream_tokens={
            src: _mask(key, nonce, f"in{src}", t) for src, t in msg.stream_tokens.items()
        },
    )
    return masked, nonce


def unmask_tokens(msg: Submit, key: bytes, nonce: bytes) -> Submit:
    """The Submit as the head built it (ValueError: tokens not masked under this key)."""
    try:
        return msgspec.structs.replace(
            msg,
            stream_token=_unmask(key, nonce, "out", msg.stream_token) if msg.stream_token else "",
            stream_tokens={
                src: _unmask(key, nonce, f"in{src}", t) for src, t in msg.stream_tokens.items()
            },
        )
    except UnicodeDecodeError as exc:
        raise ValueError(f"edge tokens not masked under this link's key ({exc})") from None
