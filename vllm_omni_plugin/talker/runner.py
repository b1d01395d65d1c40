"""The Qwen3-Omni talker's forward passes, batched across requests (torch only).

Weights are transformers' own modules (`Qwen3OmniMoeTalkerForConditionalGeneration`, loaded
from the checkpoint's talker.* tensors, and the thinker's token embedding); this module only
drives them: every projection, norm, MoE block and the code predictor run on the whole batch,
attention runs per request over that request's own KV cache (requests have different lengths).
Text-only prompts: the three 3-D rope position components are equal, which is plain 1-D rope.

One decode step for a batch (transformers does the same in `prepare_inputs_for_generation`):
  1. the code predictor completes the frame of each request's last first-group code: greedy,
     `num_code_groups - 1` sub-steps over [last hidden, embed(code0)], batched (all requests
     are at the same sub-step);
  2. the talker's input: the sum of the frame's code embeddings + the trailing text entry;
  3. one talker forward (all requests, one position each) -> codec head -> the next first-group
     code (greedy, with the codec specials suppressed as transformers' generate does).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_talker(model_dir: str | Path, device: str = "cpu", dtype: str = "float32"):
    """(Qwen3OmniMoeConfig, talker module, thinker token embedding) from a checkpoint."""
    from safetensors import safe_open
    from transformers import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

    model_dir = Path(model_dir)
    config = Qwen3OmniMoeConfig.from_pretrained(model_dir)
    talker = hf.Qwen3OmniMoeTalkerForConditionalGeneration._from_config(config.talker_config)
    text_cfg = config.thinker_config.text_config
    embed = torch.nn.Embedding(text_cfg.vocab_size, text_cfg.hidden_size)
    talker_state, embed_key = {}, "thinker.model.embed_tokens.weight"
    for shard in _shards(model_dir):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                if key.startswith("talker."):
                    talker_state[key[len("talker.") :]] = f.get_tensor(key)
                elif key == embed_key:
                    embed.weight.data.copy_(f.get_tensor(key))
                    embed_key = None
    if not talker_state or embed_key is not None:
        raise ValueError(f"{model_dir}: no talker.* weights or no thinker embedding")
    # transformers' loader merges the per-expert tensors of the hub files into 3-D ones.
    talker_state = _merge_experts(talker_state)
    missing, unexpected = talker.load_state_dict(talker_state, strict=False)
    if missing or unexpected:
        raise ValueError(f"talker weights: missing {missing[:5]}, unexpected {unexpected[:5]}")
    dt = _DTYPES[dtype]
    return config, talker.to(device, dt).eval(), embed.to(device, dt).eval()


def _merge_experts(state: dict) -> dict:
    """`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight` -> the 3-D `gate_up_proj` /
    `down_proj` tensors transformers' experts module holds."""
    out, experts = {}, {}
    for key, value in state.items():
        parts = key.split(".")
        if ".mlp.experts." in key and parts[-2] in ("gate_proj", "up_proj", "down_proj"):
            prefix = ".".join(parts[: parts.index("experts") + 1])
            experts.setdefault(prefix, {}).setdefault(parts[-2], {})[int(parts[-3])] = value
        else:
            out[key] = value
    for prefix, groups in experts.items():
        n = len(groups["down_proj"])
        gate = torch.stack([groups["gate_proj"][e] for e in range(n)])
        up = torch.stack([groups["up_proj"][e] for e in range(n)])
        out[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{prefix}.down_proj"] = torch.stack([groups["down_proj"][e] for e in range(n)])
    return out


def _shards(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / f for f in files]
    return [model_dir / "model.safetensors"]


class KVCache:
    """One request's keys and values per layer, `[kv_heads, T, head_dim]` each."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=1)
            self.values[layer] = torch.cat([self.values[layer], v], dim=1)
        return self.keys[layer], self.values[layer]

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[1]


class TalkerRunner:
    def __init__(self, config, talker):
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            apply_rotary_pos_emb,
        )

        self.config = config
        self.talker = talker
        self.model = talker.model
        self.predictor = talker.code_predictor
        self._rope = apply_rotary_pos_emb
        tcfg = config.talker_config
        self.num_groups = tcfg.num_code_groups
        self.eos = tcfg.codec_eos_token_id
        vocab = tcfg.text_config.vocab_size
        suppress = torch.zeros(vocab, dtype=torch.bool)
        suppress[max(0, vocab - 1024) :] = True  # transformers' generate: all but EOS
        suppress[self.eos] = False
        self.suppress = suppress

    @property
    def device(self) -> torch.device:
        return self.talker.codec_head.weight.device

    def new_cache(self) -> KVCache:
        return KVCache(len(self.model.layers))

    @torch.inference_mode()
    def prefill(self, embeds: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, int]:
        """One request's prompt `[L, H]` -> (last hidden `[H]`, first code0)."""
        positions = torch.arange(embeds.shape[0], device=self.device)
        hidden = self._forward(embeds[None], positions[None], [cache])[0, -1]
        return hidden, int(self._first_codes(hidden[None])[0])

    @torch.inference_mode()
    def decode(
        self,
        last_hidden: torch.Tensor,
        code0: torch.Tensor,
        text: torch.Tensor,
        caches: list[KVCache],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step for B requests: `last_hidden` `[B, H]`, `code0` `[B]` (their last first-group
        codes), `text` `[B, H]` (their trailing text entries) -> (frames `[B, G]` completed by
        this step, new last hidden `[B, H]`, next code0 `[B]`)."""
        residual = self._predict_residuals(last_hidden, code0)  # [B, G - 1]
        frames = torch.cat([code0[:, None], residual], dim=1)
        embeds = self.model.get_input_embeddings()(code0)
        for j in range(1, self.num_groups):
            embeds = embeds + self.predictor.model.codec_embedding[j - 1](residual[:, j - 1])
        embeds = embeds + text
        positions = torch.tensor([c.length for c in caches], device=self.device)[:, None]
        hidden = self._forward(embeds[:, None], positions, caches)[:, -1]
        return frames, hidden, self._first_codes(hidden)

    def _first_codes(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.talker.codec_head(hidden).float()
        logits[:, self.suppress.to(logits.device)] = float("-inf")
        return logits.argmax(-1)

    def _predict_residuals(self, last_hidden: torch.Tensor, code0: torch.Tensor) -> torch.Tensor:
        """Greedy code predictor, batched: the code groups 1.. of each request's frame."""
        pred = self.predictor.model
        x = torch.stack([last_hidden, self.model.get_input_embeddings()(code0)], dim=1)
        codes = []
        caches = [KVCache(len(pred.layers)) for _ in range(x.shape[0])]
        pos = torch.arange(2, device=self.device)[None].expand(x.shape[0], -1)
        for j in range(self.num_groups - 1):
            h = self._forward(x, pos, caches, stack=pred, rotary_3d=False)[:, -1]
            code = self.predictor.lm_head[j](h).float().argmax(-1)
            codes.append(code)
            x = pred.codec_embedding[j](code)[:, None]
            pos = pos[:, -1:] + 1
        return torch.stack(codes, dim=1)

    def _forward(self, x, positions, caches, stack=None, rotary_3d=True) -> torch.Tensor:
        """Decoder stack over `x` `[B, T, H]` at `positions` `[B, T]`, appending to each
        request's cache; returns the final-norm hidden states `[B, T, H]`."""
        stack = stack or self.model
        pos = positions[None].expand(3, -1, -1) if rotary_3d else positions
        cos, sin = stack.rotary_emb(x, pos)
        for i, layer in enumerate(stack.layers):
            h = layer.input_layernorm(x)
            h = self._attention(layer.self_attn, h, cos, sin, caches, i)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return stack.norm(x)

    def _attention(self, attn, h, cos, sin, caches, layer_idx) -> torch.Tensor:
        b, t, _ = h.shape
        shape = (b, t, -1, attn.head_dim)
        q = attn.q_norm(attn.q_proj(h).view(shape)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(h).view(shape)).transpose(1, 2)
        v = attn.v_proj(h).view(shape).transpose(1, 2)
        q, k = self._rope(q, k, cos, sin)
        out = []
        for r, cache in enumerate(caches):
            keys, values = cache.append(layer_idx, k[r], v[r])
            groups = q.shape[1] // keys.shape[0]
            keys = keys.repeat_interleave(groups, dim=0)
            values = values.repeat_interleave(groups, dim=0)
            past = keys.shape[1] - t
            mask = torch.ones(t, keys.shape[1], dtype=torch.bool, device=h.device).tril(past)
            out.append(
                F.scaled_dot_product_attention(
                    q[r : r + 1], keys[None], values[None], attn_mask=mask, scale=attn.scaling
                )
            )
        o = torch.cat(out, dim=0).transpose(1, 2).reshape(b, t, -1)
        return attn.o_proj(o)
