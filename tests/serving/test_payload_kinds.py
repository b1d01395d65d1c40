"""A real diffusion stage process refuses a payload of kind "object" (what the old encoding
pickled, and what a peer on the node link could choose): the descriptor names a real shm file
holding a pickle that would create a file if it ran. The stage logs the refusal, answers that
request with an error Result, never runs the pickle, and serves the next request normally.

Real parts: the tiny Qwen-Image checkpoint, a StageClient spawning `stages.worker`, the shm
connector (the file is written by a real ShmConnector put).
"""

from __future__ import annotations

import asyncio

import msgspec

from vllm_omni_plugin.common.messages import GenerationParams, Submit
from vllm_omni_plugin.common.payload import Via
from vllm_omni_plugin.config import ConnectorSpec, load_deploy_config
from vllm_omni_plugin.config.stage_init import StageInit
from vllm_omni_plugin.connectors import make_connector
from vllm_omni_plugin.orchestrator.stage_client import StageClient


def evil_pickle(path: str) -> bytes:
    import pickle

    class Marker:
        def __reduce__(self):
            return (open, (path, "w"))

    return pickle.dumps(Marker(), protocol=pickle.HIGHEST_PROTOCOL)


def test_a_stage_refuses_an_object_payload_and_keeps_serving(tiny_models, tmp_path):
    cfg = load_deploy_config("qwen_image_tiny", model=str(tiny_models("qwen-image")))
    spec = cfg.topology.stages[0]
    shm = ConnectorSpec(name="edge", type="shm", options={"shm_dir": str(tmp_path)})
    init = StageInit(cfg.stage(0), spec, cfg.pipeline, {"edge": shm})
    marker = tmp_path / "ran"
    producer = make_connector("shm", name="edge", shm_dir=str(tmp_path))
    honest = producer.put("evil", 0, 0, evil_pickle(str(marker)))  # a real omni shm file
    forged = Via("edge", msgspec.structs.replace(honest, kind="object"))
    params = GenerationParams("a cat", seed=1, num_inference_steps=1)

    async def run():
        client = StageClient(init, startup_timeout_s=300, restart=False)
        await client.start()
        try:
            refused = await client.submit(Submit("evil", params, inputs={0: forged}))
            served = await client.submit(Submit("next", params))
            return refused, served, client.ready
        finally:
            await asyncio.to_thread(client.shutdown)

    refused, served, ready = asyncio.run(run())
    assert refused.error is not None and "kind 'object' refused" in refused.error
    assert refused.error_field is None  # not the client's fault: a 5xx, not a 400
    assert not marker.exists()  # the pickle never ran
    assert served.error is None and len(served.output) == 1 and served.output[0][:4] == b"\x89PNG"
    assert ready  # the same process serves on
    producer.close()
