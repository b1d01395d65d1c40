"""GLM-Image's AR stage as a native vLLM model (text-to-image and image-to-image).

The math follows transformers' `GlmImageForConditionalGeneration` (text decoder only):
GLM-4 decoder layers with sandwich norms (post-attention and post-MLP RMSNorm), q/k/v with bias,
partial NeoX-style rotary with three M-RoPE sections (t, h, w), and an `lm_head` with
`vision_vocab_size` rows. Built from vLLM's tensor-parallel layers (QKVParallelLinear,
RowParallelLinear, MergedColumnParallelLinear, ParallelLMHead, Attention), so TP works on GPU.

GLM-Image specifics written here: the decode-time grid positions (see families/glm_image/positions.py) and
logits padded from `vision_vocab_size` to the text vocabulary vLLM samples over.

Image-to-image goes through vLLM's multimodal input path (processor in `mm_processing.py`):
each source image's `<|image|>` placeholder is expanded to one token per vision patch; the
checkpoint's own vision tokenizer (transformers' GlmImageVisionModel + GlmImageVQVAE, loaded
from `model.visual.*` / `model.vqmodel.*`) turns the image into VQ codes, and the codes' text
embeddings take the placeholders' place, as transformers scatters the codes into input_ids.
Source image tokens get 2-D positions (transformers' `get_rope_index`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.interfaces import SupportsMRoPE, SupportsMultiModal, SupportsPP
from vllm.model_executor.models.llama import LlamaMLP, LlamaModel
from vllm.model_executor.models.utils import AutoWeightsLoader, PPMissingLayer, maybe_prefix
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.sequence import IntermediateTensors

from vllm_omni_plugin.families.glm_image.positions import GridPositionCodec, T2ILayout
from vllm_omni_plugin.families.glm_image.processing import (
    parse_t2i_layout,
    source_image_codes,
    source_positions,
)
from vllm_omni_plugin.models.glm_image.mm_processing import (
    GlmImageDummyInputsBuilder,
    GlmImageMultiModalProcessor,
    GlmImageProcessingInfo,
)

# Under "vllm." so vLLM's own log handler prints it in worker processes.
logger = init_logger("vllm.omni_plugin.glm_image")


class GlmImageAttention(nn.Module):
    def __init__(self, config, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        total_heads, total_kv = config.num_attention_heads, config.num_key_value_heads
        assert total_heads % tp == 0 and (total_kv % tp == 0 or tp % total_kv == 0)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.q_size = total_heads // tp * self.head_dim
        self.kv_size = max(1, total_kv // tp) * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            total_heads,
            total_kv,
            bias=config.attention_bias,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim,
            config.hidden_size,
            bias=False,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.o_proj",
        )
        # transformers' GLM-Image rotates halves (NeoX style), unlike GLM-4's interleaved
        # rotary, and defaults partial_rotary_factor to 1.0 when the config omits it.
        rope = dict(config.rope_parameters)
        rope.setdefault("partial_rotary_factor", 1.0)
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=rope,
            is_neox_style=True,
        )
        self.attn = Attention(
            total_heads // tp,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=max(1, total_kv // tp),
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class GlmImageDecoderLayer(nn.Module):
    """GLM-4 layer: norm -> attn -> norm (+res); norm -> mlp -> norm (+res)."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        eps = config.rms_norm_eps
        self.self_attn = GlmImageAttention(config, vllm_config, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, eps=eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # vLLM's fused RMSNorm(x, residual) adds the residual first and returns the new one.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states = self.post_self_attn_layernorm(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.post_mlp_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


@support_torch_compile(
    dynamic_arg_dims={
        "input_ids": 0,
        "positions": -1,
        "intermediate_tensors": 0,
        "inputs_embeds": 0,
    }
)
class GlmImageTextModel(LlamaModel):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=GlmImageDecoderLayer)
        self.codec = GridPositionCodec(vllm_config.model_config.max_model_len)
        # Same tensor as codec.table, registered so it lives with the model (and compiles).
        self.register_buffer("grid_table", self.codec.table, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        # vLLM hands decode tokens addresses, not positions; turn them into (t, h, w).
        positions = self.codec.decode(positions, self.grid_table)
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)


def _split_hf_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF checkpoint names -> this module's names (vision tokenizer: `visual.*`, `vqmodel.*`)."""
    for name, tensor in weights:
        if name.startswith("lm_head."):
            yield name, tensor
            continue
        if name.startswith(("model.visual.", "model.vqmodel.")):
            yield name[len("model.") :], tensor
            continue
        if not name.startswith("model.language_model."):
            continue
        name = "model." + name[len("model.language_model.") :]
        if ".mlp.gate_up_proj." in name:
            # HF stores [gate; up] fused; split so each TP rank loads its own slice of both.
            gate, up = tensor.chunk(2, dim=0)
            yield name.replace("gate_up_proj", "gate_proj"), gate
            yield name.replace("gate_up_proj", "up_proj"), up
        else:
            yield name, tensor


def _load_tokenizer(paths: list[str | None]):
    """GLM-Image's processor tokenizer (it knows `<sop>`/`<eop>`), from the first path that has one."""
    from transformers import AutoTokenizer

    errors = []
    for path in paths:
        if not path:
            continue
        try:
            return AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # try the next candidate
            errors.append(f"{path}: {exc}")
    raise RuntimeError(
        "GLM-Image AR reads target grids from prompts and needs its processor tokenizer "
        "(pass tokenizer=<checkpoint>/processor): " + "; ".join(errors)
    )


def _vision_tokenizer(config) -> tuple[nn.Module, nn.Module]:
    """The checkpoint's vision encoder and VQ quantizer, as transformers defines them (they run
    once per source image; exact codes matter more than speed here)."""
    from transformers.models.glm_image.modeling_glm_image import (
        GlmImageVisionModel,
        GlmImageVQVAE,
    )

    vision_config = config.vision_config
    vision_config._attn_implementation = "sdpa"
    return GlmImageVisionModel(vision_config).eval(), GlmImageVQVAE(config.vq_config).eval()


def _as_tensor(value) -> torch.Tensor:
    if isinstance(value, (list, tuple)):
        return torch.cat(
            [torch.as_tensor(v).reshape(-1, *torch.as_tensor(v).shape[-1:]) for v in value]
        )
    return value


@MULTIMODAL_REGISTRY.register_processor(
    GlmImageMultiModalProcessor,
    info=GlmImageProcessingInfo,
    dummy_inputs=GlmImageDummyInputsBuilder,
)
class GlmImageForConditionalGeneration(nn.Module, SupportsMultiModal, SupportsMRoPE, SupportsPP):
    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        return "<|image|>" if modality.startswith("image") else None

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        text_config = config.text_config
        self.config = config
        model_config = vllm_config.model_config
        self.model = GlmImageTextModel(
            vllm_config=vllm_config.with_hf_config(text_config),
            prefix=maybe_prefix(prefix, "model"),
        )
        self.vocab_size = text_config.vocab_size
        self.vision_vocab_size = text_config.vision_vocab_size
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(
                self.vision_vocab_size,
                text_config.hidden_size,
                quant_config=vllm_config.quant_config,
                prefix=maybe_prefix(prefix, "lm_head"),
            )
            self.logits_processor = LogitsProcessor(self.vision_vocab_size)
        else:
            self.lm_head = PPMissingLayer()
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        self.visual, self.vqmodel = _vision_tokenizer(config)
        # Where to find the tokenizer that reads the grid sizes back from prompts.
        # Loaded now so a missing tokenizer fails the start-up, not the first request.
        self._tokenizer = _load_tokenizer(
            [model_config.tokenizer, str(Path(model_config.model).parent / "processor")]
        )

    # vLLM model interface

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings=None,
        *,
        is_multimodal: torch.Tensor | None = None,
    ) -> torch.Tensor:
        embeds = self.model.embed_input_ids(input_ids)
        if multimodal_embeddings is None or len(multimodal_embeddings) == 0:
            return embeds
        assert is_multimodal is not None
        flat = torch.cat(list(multimodal_embeddings)).to(embeds.dtype)
        embeds[is_multimodal.to(embeds.device)] = flat
        return embeds

    def embed_multimodal(self, **kwargs: object) -> list[torch.Tensor]:
        """One [h * w, hidden] tensor per source image: the text embeddings of its VQ codes."""
        pixel_values = kwargs.get("pixel_values")
        grid = kwargs.get("image_grid_thw")
        if pixel_values is None or grid is None:
            return []
        codes = self.image_codes(_as_tensor(pixel_values), _as_tensor(grid).reshape(-1, 3))
        return [self.model.embed_input_ids(c) for c in codes]

    @torch.inference_mode()
    def image_codes(self, pixel_values: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        return source_image_codes(self.visual, self.vqmodel, pixel_values, grid)

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
        logits = self.logits_processor(self.lm_head, hidden_states)
        if logits is None:  # non-driver TP rank
            return None
        # The head only scores vision ids; text ids can never be sampled.
        pad = self.vocab_size - logits.shape[-1]
        return nn.functional.pad(logits, (0, pad), value=float("-inf")) if pad > 0 else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(_split_hf_weights(weights))

    # M-RoPE: prompt positions and the per-request delta vLLM adds at decode time

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: list
    ) -> tuple[torch.Tensor, int]:
        codec = self.model.codec
        images = sorted(
            (f.mm_position.offset, *self._grid_of(f))
            for f in (mm_features or [])
            if f.modality == "image"
        )
        if not images:
            return codec.prompt_positions(self._layout(input_tokens, 2), len(input_tokens))
        prompt_len = self._prompt_len(input_tokens)
        prompt, start = source_positions(prompt_len, images)
        layout = self._layout(input_tokens, 1)
        if layout is not None:
            layout = T2ILayout(prompt_len=layout.prompt_len, grids=layout.grids, start=start)
        return codec.prompt_positions(layout, len(input_tokens), prompt)

    @staticmethod
    def _grid_of(feature) -> tuple[int, int]:
        t, h, w = (int(x) for x in feature.data["image_grid_thw"].data.tolist())
        return h, w

    def _prompt_len(self, input_tokens: list[int]) -> int:
        # The prompt ends at its last image-start token (what follows was generated).
        start_id = self.config.image_start_token_id
        for i in range(len(input_tokens) - 1, -1, -1):
            if input_tokens[i] == start_id:
                return i + 1
        return len(input_tokens)

    def _layout(self, input_tokens: list[int], num_grids: int) -> T2ILayout | None:
        tok = self._tokenizer
        try:
            return parse_t2i_layout(
                input_tokens,
                grid_bos_id=tok.convert_tokens_to_ids(getattr(tok, "grid_bos_token", "<sop>")),
                grid_eos_id=tok.convert_tokens_to_ids(getattr(tok, "grid_eos_token", "<eop>")),
                image_start_id=self.config.image_start_token_id,
                decode=tok.decode,
                num_grids=num_grids,
            )
        except ValueError as exc:  # grid out of range: never kill the engine over one prompt
            logger.warning("GLM-Image: ignoring target grids of a prompt: %s", exc)
            return None
