"""The Qwen3-Omni talker's forward passes, batched across requests.

Weights are transformers' own modules (`Qwen3OmniMoeTalkerForConditionalGeneration`, loaded
from the checkpoint's talker.* tensors, and the thinker's token embedding); this module runs
them on the whole batch, each decoder layer with as few kernels as it allows (layers.py).
Text-only prompts: the three 3-D rope position components are equal, which is plain 1-D rope.

One decode step for a batch (transformers does the same in `prepare_inputs_for_generation`):
  1. the code predictor completes the frame of each request's last first-group code: greedy,
     `num_code_groups - 1` sub-steps over [last hidden, embed(code0)], batched (all requests
     are at the same sub-step, so its small KV cache is one fixed-size tensor per layer);
  2. the talker's input: the sum of the frame's code embeddings + the trailing text entry;
  3. one talker forward (all requests, one position each, keys in their cache slots:
     cache.py) -> codec head -> the next first-group code (greedy, with the codec specials
     suppressed as transformers' generate does).
A decode step has fixed shapes for a batch size and cache allocation and never waits on the
host, so graphs.py can capture it whole in a CUDA graph. Prefill runs eagerly, the prompts that
arrived together in one padded batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .cache import SlotKVCache
from .layers import Layer, add_rms, rms, rope_table, sdpa

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


class TalkerRunner:
    def __init__(self, config, talker, max_batch_size: int = 64, max_len: int | None = None):
        self.config = config
        self.talker = talker
        self.model = talker.model
        self.predictor = talker.code_predictor
        tcfg = config.talker_config
        self.num_groups = tcfg.num_code_groups
        self.eos = tcfg.codec_eos_token_id
        vocab = tcfg.text_config.vocab_size
        suppress = torch.zeros(vocab, dtype=torch.bool)
        suppress[max(0, vocab - 1024) :] = True  # transformers' generate: all but EOS
        suppress[self.eos] = False
        self.suppress = suppress.to(self.device)
        self.talker_layers = [Layer(layer) for layer in self.model.layers]
        self.predictor_layers = [Layer(layer) for layer in self.predictor.model.layers]
        # A frame's input is the sum of its code embeddings: the first group's from the talker's
        # table, the others' from the predictor's, gathered at once from one stacked tensor.
        tables = self.predictor.model.codec_embedding
        self._codec_tables = torch.stack([t.weight.data for t in tables])
        for i, table in enumerate(tables):
            table.weight.data = self._codec_tables[i]
        weight = talker.codec_head.weight
        attn = self.model.layers[0].self_attn
        self.cache = SlotKVCache(
            len(self.model.layers),
            max_batch_size,
            attn.k_proj.out_features // attn.head_dim,
            attn.head_dim,
            weight.dtype,
            weight.device,
            limit=max_len,
        )
        # Sub-step j of the code predictor reads positions up to j + 1.
        self._predictor_rope = rope_table(
            self.predictor.model.rotary_emb, self.num_groups + 1, 1, weight
        )
        self._talker_rope = rope_table(self.model.rotary_emb, self.cache.capacity, 3, weight)
        for layer in self.talker_layers:
            layer.check_gpu_kernels(self._talker_rope)
        for layer in self.predictor_layers:
            layer.check_gpu_kernels(self._predictor_rope)

    @property
    def gpu_kernels(self) -> dict[str, bool]:
        """Whether every layer runs vLLM's GPU-only kernels (layers.Layer.check_gpu_kernels)."""
        layers = self.talker_layers + self.predictor_layers
        moe = [layer for layer in layers if layer.router_weight is not None]
        return {
            "fused_qk_norm_rope": all(layer.fused_qk_norm_rope for layer in layers),
            "fused_moe": bool(moe) and all(layer.fused_moe for layer in moe),
        }

    @property
    def device(self) -> torch.device:
        return self.talker.codec_head.weight.device

    def reserve(self, length: int) -> None:
        """Room for `length` positions per request (the cache, and its rope table with it)."""
        self.cache.reserve(length)
        if self._talker_rope.shape[0] < self.cache.capacity:
            self._talker_rope = rope_table(
                self.model.rotary_emb, self.cache.capacity, 3, self._talker_rope
            )

    @torch.inference_mode()
    def prefill(
        self, prompts: list[torch.Tensor], slots: list[int]
    ) -> tuple[torch.Tensor, list[int]]:
        """Prompts `[L_i, H]` into their cache slots (from position 0), as one right-padded
        batch -> (last hidden `[B, H]`, each one's first code0). Padding keys are masked; they
        land in the slots past each prompt, where decode steps overwrite them before any row
        can see them."""
        lengths = [p.shape[0] for p in prompts]
        longest, b = max(lengths), len(prompts)
        self.reserve(longest)
        x = prompts[0].new_zeros(b, longest, prompts[0].shape[1])
        for row, prompt in enumerate(prompts):
            x[row, : prompt.shape[0]] = prompt
        positions = torch.arange(longest, device=self.device)
        mask = None  # one prompt: plain causal attention
        if b > 1:
            ends = torch.tensor(lengths, device=self.device)
            causal = torch.ones(longest, longest, dtype=torch.bool, device=self.device).tril()
            mask = (causal[None] & (positions[None] < ends[:, None])[:, None, :])[:, None]
        rows = torch.tensor(slots, device=self.device)

        def attend(i, attn, q, k, v):
            self.cache.keys[i, rows, :, :longest] = k
            self.cache.values[i, rows, :, :longest] = v
            return sdpa(q, k, v, attn.scaling, mask, causal=mask is None)

        h = self._stack(
            self.talker_layers,
            x.view(b * longest, -1),
            positions.repeat(b),
            self._talker_rope,
            attend,
            (b, longest),
            self.model.norm,
        )
        last = torch.tensor([n - 1 for n in lengths], device=self.device)
        hidden = h.view(b, longest, -1)[torch.arange(b, device=self.device), last]
        return hidden, self._first_codes(hidden).tolist()

    @torch.inference_mode()
    def decode(
        self,
        last_hidden: torch.Tensor,
        code0: torch.Tensor,
        text: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step for B requests: `last_hidden` `[B, H]`, `code0` `[B]` (their last first-group
        codes), `text` `[B, H]` (their trailing text entries), `slots` `[B]` (their cache slots)
        and `positions` `[B]` (their lengths so far: where this step writes) -> (frames
        `[B, G]` completed by this step, new last hidden `[B, H]`, next code0 `[B]`). The caller
        reserves room for position max(positions) first (`reserve`)."""
        residual = self._predict_residuals(last_hidden, code0)  # [B, G - 1]
        frames = torch.cat([code0[:, None], residual], dim=1)
        groups = torch.arange(self.num_groups - 1, device=code0.device)
        embeds = torch.cat(
            [
                self.model.get_input_embeddings()(code0)[:, None],
                self._codec_tables[groups, residual],
            ],
            dim=1,
        )
        x = embeds.sum(dim=1) + text
        # Each row sees its own positions 0..position: later ones belong to nothing yet.
        visible = torch.arange(self.cache.capacity, device=x.device)[None] <= positions[:, None]
        mask = visible[:, None, None]

        def attend(i, attn, q, k, v):
            keys, values = self.cache.keys[i], self.cache.values[i]
            keys[slots, :, positions] = k[:, :, 0]
            values[slots, :, positions] = v[:, :, 0]
            return sdpa(q, keys[slots], values[slots], attn.scaling, mask)

        hidden = self._stack(
            self.talker_layers,
            x,
            positions,
            self._talker_rope,
            attend,
            (x.shape[0], 1),
            self.model.norm,
        )
        return frames, hidden, self._first_codes(hidden)

    def _first_codes(self, hidden: torch.Tensor) -> torch.Tensor:
        # argmax in the logits' own dtype: a float32 copy ranks them the same.
        logits = self.talker.codec_head(hidden)
        return logits.masked_fill(self.suppress, float("-inf")).argmax(-1)

    def _predict_residuals(self, last_hidden: torch.Tensor, code0: torch.Tensor) -> torch.Tensor:
        """Greedy code predictor, batched: the code groups 1.. of each request's frame.
        Sub-step 0 reads positions 0-1 ([last hidden, embed(code0)]), sub-step j position j + 1."""
        pred = self.predictor.model
        attn0 = pred.layers[0].self_attn
        b, device = last_hidden.shape[0], last_hidden.device
        shape = (len(pred.layers), b, attn0.k_proj.out_features // attn0.head_dim)
        shape += (self.num_groups, attn0.head_dim)
        keys = last_hidden.new_zeros(shape)
        values = last_hidden.new_zeros(shape)
        x = torch.stack([last_hidden, self.model.get_input_embeddings()(code0)], dim=1)
        x = x.view(2 * b, -1)
        codes = []
        for j in range(self.num_groups - 1):
            if j == 0:
                start, t = 0, 2
                positions = torch.arange(2, device=device).repeat(b)
            else:
                start, t = j + 1, 1
                positions = torch.full((b,), start, device=device)
            end = start + t

            def attend(i, attn, q, k, v, start=start, end=end, causal=j == 0):
                keys[i, :, :, start:end] = k
                values[i, :, :, start:end] = v
                return sdpa(
                    q, keys[i, :, :, :end], values[i, :, :, :end], attn.scaling, causal=causal
                )

            h = self._stack(
                self.predictor_layers,
                x,
                positions,
                self._predictor_rope,
                attend,
                (b, t),
                pred.norm,
            )
            code = self.predictor.lm_head[j](h.view(b, t, -1)[:, -1]).argmax(-1)
            codes.append(code)
            x = pred.codec_embedding[j](code)
        return torch.stack(codes, dim=1)

    def _stack(self, layers, x, positions, rope, attend, shape, final_norm) -> torch.Tensor:
        """Tokens `x` `[N, H]` (N = B x T, overwritten: the residual stream) at `positions`
        `[N]` through `layers`, then `final_norm` -> `[N, H]`. `attend(i, attn, q, k, v)`:
        layer i's attention output `[B, heads, T, D]` for q `[B, heads, T, D]` and this step's
        k, v `[B, kv_heads, T, D]` (it stores them where its cache wants them)."""
        residual = x
        x = rms(layers[0].input_norm, x)
        for i, layer in enumerate(layers):
            if i:
                add_rms(x, residual, layer.input_norm)
            q, k, v = layer.qkv(x, positions, rope, shape)
            o = attend(i, layer.attn, q, k, v)
            x = layer.attn.o_proj(o.transpose(1, 2).reshape(x.shape[0], -1))
            add_rms(x, residual, layer.post_norm)
            x = layer.feed_forward(x)
        add_rms(x, residual, final_norm)
        return x
