"""One talker decoder layer's pieces with as few kernels as they allow (runner.py stacks them).

A decode step at batch 1 is ~95 layer passes of small kernels (20 talker layers, 15 sub-steps of
the 5-layer code predictor): it is bound by how many kernels it launches, not by the bytes it
reads. So, over transformers' own modules and weights:
  - q/k/v are one matmul, and a SiLU MLP's gate/up are one; in a MoE block the router and the
    shared expert's gate are one too (`fuse_rows`: the modules' weights become row views of the
    fused tensor, nothing is held twice);
  - vLLM's kernels: residual add + RMSNorm, rope on q and k at once from a cos/sin table, SiLU x
    up; on a GPU also the q/k norms and the rope as one kernel, and the MoE blocks' routed experts
    as vLLM's fused MoE (Triton) kernels.
The two GPU-only kernels are used where vLLM would use them, and each is checked at load against
the plain path on one probe input (`Layer.check_gpu_kernels`): one that fails or disagrees is not
used, with a warning.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from vllm._custom_ops import fused_add_rms_norm, fused_qk_norm_rope, rotary_embedding
from vllm.triton_utils import HAS_TRITON

logger = logging.getLogger("vllm_omni_plugin.talker")

# Relative max difference a GPU-only kernel may show against the plain path on the probe
# (bf16 rounding gives ~1e-2; a kernel that computes something else, ~1).
_PROBE_TOLERANCE = 0.05


def rms(norm, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm module `norm` applied as torch's rms_norm: one fused kernel on a
    GPU where the module's own forward launches eight. It scales in float32 and rounds once;
    the module rounds before its weight (bf16: within an ulp; float32: equal up to summation
    order)."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def add_rms(x: torch.Tensor, residual: torch.Tensor, norm) -> None:
    """In place, one kernel: `residual += x`, then `x = norm(residual)`."""
    fused_add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)


def sdpa(q, k, v, scale, mask=None, causal=False) -> torch.Tensor:
    """Attention of q `[B, heads, T, D]` over k, v `[B, kv_heads, L, D]` (grouped queries)."""
    b, heads, t, d = q.shape
    kv_heads = k.shape[1]
    if t == 1 and heads != kv_heads:
        # One position: each key head's group of query heads attends as one block of queries,
        # so the keys are read once, not repeated per query head.
        grouped = q.reshape(b, kv_heads, heads // kv_heads, d)
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
        return out.reshape(b, heads, 1, d)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=heads != kv_heads
    )


def fuse_rows(*linears) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """(weight, bias, output sizes) of one projection computing several of the same input;
    each module's weight (and bias) becomes a view of its rows of the fused tensor."""
    weight = torch.cat([m.weight.data for m in linears])
    biases = [getattr(m, "bias", None) for m in linears]  # a MoE router has no bias at all
    bias = torch.cat([b.data for b in biases]) if all(b is not None for b in biases) else None
    if bias is None and any(b is not None for b in biases):
        raise ValueError("projections with and without bias cannot be fused")
    sizes, start = [], 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[start : start + n]
        if bias is not None:
            m.bias.data = bias[start : start + n]
        sizes.append(n)
        start += n
    return weight, bias, sizes


def rope_table(rotary_emb, length: int, dims: int, like: torch.Tensor) -> torch.Tensor:
    """vLLM's cos/sin cache `[length, head_dim]` (cos halves, then sin halves) for positions
    0..length-1, from transformers' rotary module (its inverse frequencies and scaling);
    `dims`: how many position components the module takes (3 for 3-D rope: all equal)."""
    positions = torch.arange(length, device=like.device)[None]
    if dims > 1:
        positions = positions[None].expand(dims, -1, -1)
    cos, sin = rotary_emb(like, positions)
    cos, sin = cos.reshape(length, -1), sin.reshape(length, -1)
    half = cos.shape[-1] // 2
    # Rotate-half ("neox") layout over the whole head: both halves hold the same angles.
    if not (
        torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])
    ):
        raise ValueError("the talker's rope is not a rotate-half rope over the whole head")
    return torch.cat([cos[:, :half], sin[:, :half]], dim=-1).to(like.dtype).contiguous()


class Layer:
    """One decoder layer (a transformers module) as the fused step runs it."""

    def __init__(self, layer):
        attn = layer.self_attn
        self.attn = attn
        self.mlp = layer.mlp
        self.qkv_weight, self.qkv_bias, self.qkv_sizes = fuse_rows(
            attn.q_proj, attn.k_proj, attn.v_proj
        )
        self.head_dim = attn.head_dim
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        # A dense MLP (the code predictor's): gate and up as one projection.
        self.gate_up = None
        # A MoE block (the talker's): the router's logits and the shared expert's gate as one
        # projection, the shared expert's gate and up as another; the routed experts are
        # transformers' (or, on a GPU, vLLM's fused_experts).
        self.router_weight = self.shared_gate_up = None
        if hasattr(layer.mlp, "gate_proj"):
            self.gate_up = _silu_gate_up(layer.mlp)
        elif hasattr(layer.mlp, "shared_expert_gate"):
            self.shared_gate_up = _silu_gate_up(layer.mlp.shared_expert)
            if self.shared_gate_up is not None:
                self.router_weight, _, _ = fuse_rows(layer.mlp.gate, layer.mlp.shared_expert_gate)
        # GPU-only kernels (check_gpu_kernels turns them on).
        self.fused_qk_norm_rope = False
        self.fused_moe = False

    # ---- attention inputs ------------------------------------------------------------------
    def qkv(self, h, positions, rope, shape) -> tuple[torch.Tensor, ...]:
        """q `[B, heads, T, D]`, k and v `[B, kv_heads, T, D]` of `h` `[B x T, H]` at
        `positions` `[B x T]`: normed and rotated."""
        b, t = shape
        d = self.head_dim
        qkv = F.linear(h, self.qkv_weight, self.qkv_bias)
        if self.fused_qk_norm_rope:  # in place in the projection's output
            heads, kv_heads = self.qkv_sizes[0] // d, self.qkv_sizes[1] // d
            q_norm, k_norm = self.attn.q_norm, self.attn.k_norm
            fused_qk_norm_rope(
                qkv, heads, kv_heads, kv_heads, d, q_norm.variance_epsilon, q_norm.weight,
                k_norm.weight, rope, True, positions,
            )  # fmt: skip
            q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = qkv.split(self.qkv_sizes, dim=-1)
            q = rms(self.attn.q_norm, q.unflatten(-1, (-1, d))).reshape(b * t, -1).contiguous()
            k = rms(self.attn.k_norm, k.unflatten(-1, (-1, d))).reshape(b * t, -1).contiguous()
            rotary_embedding(positions, q, k, d, rope, True)
        return tuple(y.reshape(b, t, -1, d).transpose(1, 2) for y in (q, k, v))

    # ---- MLP -------------------------------------------------------------------------------
    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's MLP or MoE block on `x` `[N, H]`."""
        if self.gate_up is not None:
            return _silu_mlp(x, self.gate_up, self.mlp.down_proj)
        if self.router_weight is not None:
            return self._moe(x)
        return self.mlp(x[None])[0]  # transformers' block as it is

    def _moe(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' talker MoE block (router, routed experts, gated shared expert) in
        fewer kernels; the routed experts as vLLM's fused_experts where `fused_moe` is on (its
        `w1` / `w2` layouts are transformers' `gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I])."""
        block = self.mlp
        router = block.gate
        logits = F.linear(x, self.router_weight)  # [N, experts + 1]: the last, the shared gate
        probs = logits[:, :-1].softmax(dim=-1, dtype=torch.float)
        weights, ids = probs.topk(router.top_k, dim=-1)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)  # transformers weighs the experts' outputs in the model dtype
        if self.fused_moe:
            # Imported here, not at module level: vLLM's fused_moe package loads opencv, which
            # sets LD_LIBRARY_PATH in our process (an import with side effects).
            from vllm.model_executor.layers.fused_moe import fused_experts

            experts = block.experts
            routed = fused_experts(
                x, experts.gate_up_proj, experts.down_proj, weights, ids.to(torch.int32)
            )
        else:
            routed = block.experts(x, ids, weights)
        shared = _silu_mlp(x, self.shared_gate_up, block.shared_expert.down_proj)
        return routed + torch.sigmoid(logits[:, -1:]) * shared

    # ---- the GPU-only kernels --------------------------------------------------------------
    @torch.inference_mode()  # as the steps run (vLLM's in-place kernels have no autograd)
    def check_gpu_kernels(self, rope: torch.Tensor) -> None:
        """Turn on the GPU-only kernels that fit this layer where vLLM has them (a CUDA build;
        bf16 / fp16; `fused_qk_norm_rope` for head sizes 64, 128, 256 and one eps, as vLLM's own
        fusion pass checks) and that agree with the plain path on a probe input."""
        weight = self.qkv_weight
        if weight.device.type != "cuda" or weight.dtype not in (torch.bfloat16, torch.float16):
            return
        gen = torch.Generator(device=weight.device).manual_seed(0)
        x = torch.randn(4, weight.shape[1], generator=gen, device=weight.device)
        x = x.to(weight.dtype)
        positions = torch.arange(4, device=weight.device)
        if (
            hasattr(torch.ops._C, "fused_qk_norm_rope")
            and self.head_dim in (64, 128, 256)
            and self.attn.q_norm.variance_epsilon == self.attn.k_norm.variance_epsilon
        ):
            plain = self.qkv(x, positions, rope, (1, 4))
            self.fused_qk_norm_rope = True
            self.fused_qk_norm_rope = _agrees(
                "fused_qk_norm_rope", lambda: self.qkv(x, positions, rope, (1, 4)), plain
            )
        if self.router_weight is not None and HAS_TRITON:
            plain = self.mlp(x[None])[0]
            self.fused_moe = True
            self.fused_moe = _agrees("fused_experts", lambda: self._moe(x), plain)


def _silu_gate_up(mlp) -> torch.Tensor | None:
    """A SiLU-gated MLP's gate and up as one projection's weight (`fuse_rows`), or None for
    another MLP (a bias, another activation: not what vLLM's silu_and_mul computes)."""
    weight, bias, _ = fuse_rows(mlp.gate_proj, mlp.up_proj)
    act = type(mlp.act_fn).__name__
    return weight if bias is None and act in ("SiLUActivation", "SiLU") else None


def _silu_mlp(x: torch.Tensor, gate_up: torch.Tensor, down_proj) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with gate and up one matmul and one fused activation."""
    h = F.linear(x, gate_up)
    out = h.new_empty(x.shape[0], h.shape[1] // 2)
    torch.ops._C.silu_and_mul(out, h)
    return down_proj(out)


def _agrees(name: str, fast, plain) -> bool:
    """Whether `fast()` gives `plain` (a tensor or tuple of them) within _PROBE_TOLERANCE of
    its largest magnitude; a kernel that raises does not agree. A disagreement is logged."""
    try:
        out = fast()
    except Exception as exc:  # a kernel this vLLM build or device does not run
        logger.warning("talker: not using vLLM's %s (%s: %s)", name, type(exc).__name__, exc)
        return False
    outs = out if isinstance(out, tuple) else (out,)
    refs = plain if isinstance(plain, tuple) else (plain,)
    worst = max(
        float((o.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-6))
        for o, r in zip(outs, refs, strict=True)
    )
    if worst > _PROBE_TOLERANCE:
        logger.warning(
            "talker: not using vLLM's %s: it differs from the plain path by %.3g (relative)",
            name,
            worst,
        )
        return False
    return True
