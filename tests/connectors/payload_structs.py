"""A struct payload for the connector tests (imported by the tests and by conn_peer.py, so both
processes know the type): the third payload kind next to tensors and bytes."""

from __future__ import annotations

import msgspec

from vllm_omni_plugin.common.payload import payload_struct


@payload_struct
class PriorSketch(msgspec.Struct, frozen=True):
    prior_token_ids: list[int]
    height: int
    note: str


class Unregistered(msgspec.Struct):
    value: int


class _Marker:
    """Unpickling this creates `path`: what an attacker's "object" payload would do, harmlessly."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def evil_pickle(path: str) -> bytes:
    import pickle

    return pickle.dumps(_Marker(path), protocol=pickle.HIGHEST_PROTOCOL)
