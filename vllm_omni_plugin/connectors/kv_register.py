"""Registration of our KV connector with vLLM, kept apart from the class so that the general
plugin (which runs in every vLLM process) imports only vLLM's factory, not the connector."""

from __future__ import annotations

KV_CONNECTOR_NAME = "OmniStageNixlConnector"
KV_CONNECTOR_MODULE = "vllm_omni_plugin.connectors.kv_connector"


def register_kv_connector() -> bool:
    """Register with KVConnectorFactory; True if registered now, False if it already was.

    General plugins run in every vLLM process, sometimes twice in one; the factory raises on a
    duplicate name, hence the check.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if KV_CONNECTOR_NAME in KVConnectorFactory._registry:
        return False
    KVConnectorFactory.register_connector(
        KV_CONNECTOR_NAME, KV_CONNECTOR_MODULE, "OmniStageNixlConnector"
    )
    return True
