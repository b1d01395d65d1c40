"""vLLM instantiates our NIXL stage connector through its KVConnectorFactory."""

from __future__ import annotations

import torch


def test_vllm_creates_the_registered_kv_connector():
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_omni_plugin.connectors import register_kv_connector
    from vllm_omni_plugin.connectors.kv_connector import KV_CONNECTOR_NAME, OmniStageNixlConnector

    register_kv_connector()
    assert register_kv_connector() is False  # plugins load many times: the second call is a no-op
    config = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector=KV_CONNECTOR_NAME,
            kv_role="kv_both",
            kv_connector_extra_config={"omni_connector": {"name": "nixl-kv", "recv_pool_mb": 8}},
        )
    )
    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        conn = KVConnectorFactory.create_connector(config, role, None)
        assert isinstance(conn, OmniStageNixlConnector) and conn.role == role
        assert conn.get_num_new_matched_tokens(None, 0) == (0, False)
    # The worker-side connector carries a working NIXL stage transport.
    other = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, None)
    try:
        hidden = torch.randn(3, 16)
        desc = conn.stage_connector.put("req", 0, 1, hidden)
        assert torch.equal(other.stage_connector.get(desc, timeout=10), hidden)
        assert conn.stage_connector.name == "nixl-kv"
    finally:
        conn.shutdown()
        other.shutdown()
