"""Qwen3-Omni's talker as a native vLLM model: codec frames out of the thinker's conditioning.

The math follows transformers' `Qwen3OmniMoeTalkerForConditionalGeneration`: a Qwen3-MoE decoder
(with a sigmoid-gated shared expert) over the talker's codec embedding, a codec head writing the
first code group of each frame, and the two projections (`text_projection`,
`hidden_projection`) that map the thinker's embeddings and hidden states into the talker's
input space. The decoder body is vLLM's own `Qwen3MoeModel` (paged attention, fused MoE), so the
talker runs on a stock vLLM engine: paged KV cache, batching, chunked prefill, vLLM's sampler.

The engine is built from the full Qwen3-Omni checkpoint: the talker stage passes
`hf_overrides=families.qwen3_omni.talker_hf_config`, which hands vLLM the checkpoint's
`talker_config` under our architecture, and `load_weights` keeps the `talker.*` tensors.

Prefill conditioning arrives as `prompt_embeds` (built as transformers' `generate` builds it:
talker/prompt.py); decode steps embed the sampled first-group code with the codec embedding.
The codec head's logits have the codec specials masked (all but EOS among the top 1024 ids of
the codec vocabulary), as transformers' `generate` suppresses them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.activation import get_act_fn
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix
from vllm.sequence import IntermediateTensors

# transformers' `Qwen3OmniMoeForConditionalGeneration.generate` suppresses this many ids at the
# top of the codec vocabulary (the codec specials and speakers), all but the codec EOS.
SUPPRESSED_TOP_IDS = 1024


class TalkerResizeMLP(nn.Module):
    """thinker width -> talker width: fc1 (bias) -> act -> fc2 (bias)."""

    def __init__(self, in_size: int, mid_size: int, out_size: int, act: str, prefix: str = ""):
        super().__init__()
        self.linear_fc1 = ReplicatedLinear(
            in_size, mid_size, bias=True, prefix=f"{prefix}.linear_fc1"
        )
        self.linear_fc2 = ReplicatedLinear(
            mid_size, out_size, bias=True, prefix=f"{prefix}.linear_fc2"
        )
        self.act_fn = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.linear_fc1(x)
        x, _ = self.linear_fc2(self.act_fn(x))
        return x


def suppressed_codec_ids(vocab_size: int, eos_id: int) -> torch.Tensor:
    """Bool `[vocab_size]`: the codec ids the talker never samples."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[max(0, vocab_size - SUPPRESSED_TOP_IDS) :] = True
    mask[eos_id] = False
    return mask


class Qwen3OmniTalkerForCodecGeneration(nn.Module):
    # Checkpoint names (the whole Qwen3-Omni checkpoint) -> this module's names. Only the
    # talker's tensors load; the thinker and Code2Wav run in their own stages.
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_prefix={
            "thinker.": None,
            "code2wav.": None,
            "talker.code_predictor.": None,
            "talker.model.codec_embedding.": "model.embed_tokens.",
            "talker.": "",
        }
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config  # Qwen3OmniMoeTalkerConfig
        text = vllm_config.model_config.hf_text_config
        self.config = config
        self.model = Qwen3MoeModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.codec_head = ParallelLMHead(
            text.vocab_size, text.hidden_size, prefix=maybe_prefix(prefix, "codec_head")
        )
        self.logits_processor = LogitsProcessor(text.vocab_size)
        for name in ("text_projection", "hidden_projection"):
            mlp = TalkerResizeMLP(
                config.thinker_hidden_size,
                text.intermediate_size,
                text.hidden_size,
                text.hidden_act,
                prefix=maybe_prefix(prefix, name),
            )
            setattr(self, name, mlp)
        self.register_buffer(
            "suppressed",
            suppressed_codec_ids(text.vocab_size, config.codec_eos_token_id),
            persistent=False,
        )
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(self.codec_head, hidden_states)
        if logits is None:  # not the last pipeline rank
            return None
        return logits.masked_fill(self.suppressed[: logits.shape[-1]], float("-inf"))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)
