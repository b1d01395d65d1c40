"""What a stage process is started with: its typed config, its pipeline role, the connectors.

The orchestrator holds a StageInit per stage; on the control socket it travels as the message
schema's StartStage (the JSON of each typed object), and the stage process validates it back
into the same types (`from_message`): typed at both ends, no pickle in between.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from vllm_omni_plugin.common.messages import StartStage
from vllm_omni_plugin.config.deploy import ConnectorSpec, StageConfig
from vllm_omni_plugin.pipelines.topology import StageSpec


@dataclass(frozen=True)
class StageInit:
    """A stage's start-up: its config, its place in the topology, the deployment's connectors."""

    stage: StageConfig
    spec: StageSpec  # kind, inputs, emits
    pipeline: str  # topology key, e.g. "glm_image"
    connectors: dict[str, ConnectorSpec] = field(default_factory=dict)  # name -> spec

    def to_message(self) -> StartStage:
        return StartStage(
            stage_id=self.stage.stage_id,
            kind=self.spec.kind,
            pipeline=self.pipeline,
            stage=self.stage.model_dump_json().encode(),
            spec=msgspec.json.encode(self.spec),
            connectors={n: c.model_dump_json().encode() for n, c in self.connectors.items()},
        )

    @classmethod
    def from_message(cls, msg: StartStage) -> StageInit:
        """The typed StageInit back (pydantic / msgspec validation errors name the field)."""
        init = cls(
            stage=StageConfig.model_validate_json(msg.stage),
            spec=msgspec.json.decode(msg.spec, type=StageSpec),
            pipeline=msg.pipeline,
            connectors={n: ConnectorSpec.model_validate_json(c) for n, c in msg.connectors.items()},
        )
        if (init.stage.stage_id, init.spec.kind) != (msg.stage_id, msg.kind):
            raise ValueError(
                f"StartStage names stage {msg.stage_id} ({msg.kind}) but carries "
                f"stage {init.stage.stage_id} ({init.spec.kind})"
            )
        return init
