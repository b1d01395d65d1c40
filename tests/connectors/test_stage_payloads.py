"""A stage releases what it emitted for a request that failed or was cancelled downstream (the
orchestrator's abort), at once and on every connector kind; a consumer releases all its inputs
even when one of them cannot be read. End to end through a served pipeline: test_glm_serve.py.
"""

from __future__ import annotations

import pytest
import torch

from vllm_omni_plugin.config.deploy import ConnectorSpec
from vllm_omni_plugin.connectors import ConnectorError
from vllm_omni_plugin.stages.payloads import StagePayloads


def payloads_for(kind: str, tmp_path) -> StagePayloads:
    options = {"shm_dir": str(tmp_path)} if kind == "shm" else {}
    name = f"payloads-{kind}"
    return StagePayloads({name: ConnectorSpec(name=name, type=kind, options=options)})


@pytest.mark.parametrize("kind", ["shm", "nixl", "inproc"])
def test_release_request_frees_what_the_producer_emitted(kind, tmp_path):
    payloads = payloads_for(kind, tmp_path)
    name = f"payloads-{kind}"
    try:
        aborted = payloads.emit(torch.arange(1000), "r1", 0, 1, name)
        payloads.emit(torch.arange(10), "r2", 0, 1, name)
        conn = payloads.connector(name)
        assert conn.pending() == 2
        assert payloads.release_request("r1") == 1
        assert conn.pending() == 1  # r2 untouched
        assert payloads.release_request("r1") == 0  # idempotent
        if kind == "shm":
            assert len(list(tmp_path.iterdir())) == 1
        with pytest.raises(ConnectorError):
            payloads.receive(aborted)
    finally:
        payloads.close()


def test_receive_all_releases_every_input_when_one_fails(tmp_path):
    payloads = payloads_for("shm", tmp_path)
    try:
        first = payloads.emit(torch.arange(5), "r", 0, 2, "payloads-shm")
        second = payloads.emit(torch.arange(7), "r", 1, 2, "payloads-shm")
        payloads.release(first)  # gone before the consumer got to it
        with pytest.raises(ConnectorError):
            payloads.receive_all([first, second])
        assert not list(tmp_path.iterdir())  # `second` was released although never read
    finally:
        payloads.close()
