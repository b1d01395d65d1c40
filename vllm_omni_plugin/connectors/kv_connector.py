"""Our NIXL stage connector as a vLLM KV connector (the only connectors module importing vLLM).

Registered with vLLM's KVConnectorFactory under the name `OmniStageNixlConnector`, so an AR stage
can be started with
    --kv-transfer-config '{"kv_connector": "OmniStageNixlConnector", "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"omni_connector": {"name": "nixl"}}}'
and its worker can export what a pipeline needs beyond token ids (hidden states, KV) through the
same NIXL transport as stage payloads (`connector.stage_connector`). Today it only carries the
transport: it loads and saves no KV blocks, so vLLM's scheduling is unchanged (0 external tokens).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from vllm_omni_plugin.connectors.base import StageConnector
from vllm_omni_plugin.connectors.kv_register import KV_CONNECTOR_NAME, register_kv_connector

__all__ = ["KV_CONNECTOR_NAME", "OmniStageNixlConnector", "register_kv_connector"]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)


class _NoKVMetadata(KVConnectorMetadata):
    pass


class OmniStageNixlConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._options: dict[str, Any] = dict(extra.get("omni_connector", {}))
        self._stage_connector: StageConnector | None = None

    @property
    def stage_connector(self) -> StageConnector:
        """The NIXL stage connector of this worker, created on first use (agent start ~0.5 s)."""
        if self._stage_connector is None:
            from vllm_omni_plugin.connectors import make_connector

            options = dict(self._options)
            self._stage_connector = make_connector("nixl", options.pop("name", "nixl"), **options)
        return self._stage_connector

    # -- scheduler side: no external KV, so vLLM schedules exactly as without a connector --
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return _NoKVMetadata()

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # -- worker side: nothing to load or save per layer ------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def shutdown(self) -> None:
        if self._stage_connector is not None:
            self._stage_connector.close()
            self._stage_connector = None
