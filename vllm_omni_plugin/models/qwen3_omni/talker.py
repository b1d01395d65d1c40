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
prompt.py). The codec head's logits have the codec specials masked (all but EOS among
the top 1024 ids of the codec vocabulary), as transformers' `generate` suppresses them. The
code predictor (`CodePredictor`, groups 1.. of each frame) and the per-step input (the frame's
code embeddings plus the thinker's text entry) run in the model runner's step around vLLM's
sampler: talker_runner.py.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.activation import SiluAndMul, get_act_fn
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix
from vllm.sequence import IntermediateTensors

# transformers' `Qwen3OmniMoeForConditionalGeneration.generate` suppresses this many ids at the
# top of the codec vocabulary (the codec specials and speakers), all but the codec EOS.
SUPPRESSED_TOP_IDS = 1024


@support_torch_compile(
    dynamic_arg_dims={
        "input_ids": 0,
        "positions": -1,
        "intermediate_tensors": 0,
        "inputs_embeds": 0,
    }
)
class TalkerDecoder(Qwen3MoeModel):
    """vLLM's Qwen3-MoE decoder, compiled with the token dimension last in `positions`: the
    talker runs 3-D (M-RoPE) positions `[3, tokens]` (talker_runner.py)."""


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


class PredictorRMSNorm(nn.Module):
    """RMS normalization in plain torch ops (transformers' Qwen3 RMSNorm). vLLM's `RMSNorm`
    calls an opaque custom op, which torch.compile can neither fuse nor see through: in the
    code predictor's compiled layers that left seven kernels per norm."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class CodePredictorLayer(nn.Module):
    """One dense Qwen3 decoder layer of the code predictor. Its sequences are at most
    `num_code_groups + 1` positions long, so attention re-reads the whole (short) sequence in
    each sub-step with torch's SDPA instead of a paged KV cache: static shapes, no cache."""

    def __init__(self, cfg, prefix: str):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            self.head_dim,
            self.num_heads,
            self.num_kv_heads,
            bias=getattr(cfg, "attention_bias", False),
            prefix=f"{prefix}.self_attn.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            self.q_size, cfg.hidden_size, bias=False, prefix=f"{prefix}.self_attn.o_proj"
        )
        self.q_norm = PredictorRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = PredictorRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=cfg.max_position_embeddings,
            rope_parameters=cfg.rope_parameters,
        )
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size,
            [cfg.intermediate_size] * 2,
            bias=False,
            prefix=f"{prefix}.mlp.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, bias=False, prefix=f"{prefix}.mlp.down_proj"
        )
        self.act_fn = SiluAndMul()
        self.input_layernorm = PredictorRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = PredictorRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x `[B, T, H]` (a causal sequence per row), positions `[T]`."""
        b, t, _ = x.shape
        h = self.input_layernorm(x.reshape(b * t, -1))
        qkv, _ = self.qkv_proj(h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).reshape(b * t, -1)
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).reshape(b * t, -1)
        q, k = self.rotary_emb(positions.repeat(b), q, k)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.num_kv_heads != self.num_heads
        )
        o, _ = self.o_proj(o.transpose(1, 2).reshape(b * t, -1))
        x = x + o.view(b, t, -1)
        h = self.post_attention_layernorm(x.reshape(b * t, -1))
        h, _ = self.gate_up_proj(h)
        h, _ = self.down_proj(self.act_fn(h))
        return x + h.view(b, t, -1)


class CodePredictor(nn.Module):
    """The talker's sub-model writing code groups 1.. of a frame from the talker's hidden state
    and the frame's first code (transformers' `Qwen3OmniMoeTalkerCodePredictorModel...`)."""

    # checkpoint name piece -> (this module's packed parameter, shard)
    stacked = (
        (".self_attn.q_proj", ".qkv_proj", "q"),
        (".self_attn.k_proj", ".qkv_proj", "k"),
        (".self_attn.v_proj", ".qkv_proj", "v"),
        (".mlp.gate_proj", ".gate_up_proj", 0),
        (".mlp.up_proj", ".gate_up_proj", 1),
    )

    def __init__(self, cfg, num_code_groups: int, prefix: str = ""):
        super().__init__()
        self.num_code_groups = num_code_groups
        self.layers = nn.ModuleList(
            CodePredictorLayer(cfg, f"{prefix}.layers.{i}") for i in range(cfg.num_hidden_layers)
        )
        self.norm = PredictorRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        n = num_code_groups - 1
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, cfg.hidden_size) for _ in range(n)
        )
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(n)
        )
        self.compiled_hidden = None  # set by compile_hidden

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, T, H]` sequences -> the last position's final hidden state `[B, H]`."""
        if self.compiled_hidden is not None:
            return self.compiled_hidden(x)
        return self.eager_hidden(x)

    def compile_hidden(self, backend: str = "inductor") -> None:
        """Run `hidden` through torch.compile from now on. Op by op, each layer of each
        sub-step launches about fifty small kernels besides its matmuls and attention (the
        norms, rotary embedding, residuals, activation); compiled, a handful. The batch and
        sequence dimensions are dynamic: the 15 sub-steps of every batch size share a compiled
        graph or two."""
        self.compiled_hidden = torch.compile(
            self.eager_hidden, backend=backend, dynamic=True, fullgraph=True
        )

    def eager_hidden(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        for layer in self.layers:
            x = layer(x, positions)
        return self.norm(x[:, -1].contiguous())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.").replace(".mlp.down_proj", ".down_proj")
            name = name.replace(".self_attn.o_proj", ".o_proj")
            name = name.replace(".self_attn.q_norm", ".q_norm")
            name = name.replace(".self_attn.k_norm", ".k_norm")
            for ckpt, packed, shard in self.stacked:
                if ckpt in name:
                    name = name.replace(ckpt, packed)
                    param = params[name]
                    param.weight_loader(param, tensor, shard)
                    break
            else:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded


class Qwen3OmniTalkerForCodecGeneration(nn.Module):
    # Checkpoint names (the whole Qwen3-Omni checkpoint) -> this module's names: the talker's
    # tensors and the thinker's token embedding (the trailing text the talker reads is thinker
    # ids); the rest of the thinker and Code2Wav run in their own stages.
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_prefix={
            "thinker.model.embed_tokens.": "thinker_embed.",
            "thinker.": None,
            "code2wav.": None,
            "talker.model.codec_embedding.": "model.embed_tokens.",
            "talker.": "",
        }
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config  # Qwen3OmniMoeTalkerConfig
        text = vllm_config.model_config.hf_text_config
        self.config = config
        self.model = TalkerDecoder(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
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
        self.num_code_groups = config.num_code_groups
        self.code_predictor = CodePredictor(
            config.code_predictor_config,
            config.num_code_groups,
            prefix=maybe_prefix(prefix, "code_predictor.model"),
        )
        self.thinker_embed = nn.Embedding(config.thinker_vocab_size, config.thinker_hidden_size)
        self.tts_ids = (config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id)
        # The hidden states compute_logits last saw (one row per sampled token): the code
        # predictor reads them once the first code of each frame is sampled.
        self.sampled_hidden: torch.Tensor | None = None
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
        self.sampled_hidden = hidden_states
        logits = self.logits_processor(self.codec_head, hidden_states)
        if logits is None:  # not the last pipeline rank
            return None
        return logits.masked_fill(self.suppressed[: logits.shape[-1]], float("-inf"))

    def project_text(self, thinker_ids: torch.Tensor) -> torch.Tensor:
        """Thinker token ids `[N]` -> the talker's text input entries `[N, H]`."""
        return self.text_projection(self.thinker_embed(thinker_ids))

    def predict_residuals(
        self, hidden: torch.Tensor, code0: torch.Tensor, sample=None
    ) -> torch.Tensor:
        """Code groups 1.. `[B, G - 1]` of the frames whose first codes `code0` `[B]` the talker
        sampled from `hidden` `[B, H]`: sub-step j reads [hidden, embed(code0), its codes so
        far] and its own head. `sample(j, logits)` draws a code; None: greedy."""
        pred = self.code_predictor
        x = torch.stack([hidden, self.embed_input_ids(code0).to(hidden.dtype)], dim=1)
        codes = []
        for j in range(self.num_code_groups - 1):
            logits = pred.lm_head[j](pred.hidden(x))
            code = logits.argmax(-1) if sample is None else sample(j, logits)
            codes.append(code)
            if j + 2 < self.num_code_groups:
                x = torch.cat([x, pred.codec_embedding[j](code)[:, None]], dim=1)
        return torch.stack(codes, dim=1)

    def residual_embedding(self, residual: torch.Tensor) -> torch.Tensor:
        """`[B, G - 1]` codes -> the sum of their embeddings `[B, H]`: with the first code's
        embedding (embed_input_ids) and a text entry, the talker's next input."""
        tables = self.code_predictor.codec_embedding
        return torch.stack([tables[j](residual[:, j]) for j in range(len(tables))]).sum(0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)
