"""Collectives on pieces of uneven size (a text of 7 tokens over 2 ranks: 4 + 3).

Every rank knows every piece's size (they follow from lengths all ranks share), so no sizes
travel; tensors travel flattened so one all_to_all_single / all_gather carries any shape.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def split_sizes(length: int, parts: int) -> list[int]:
    """`length` items over `parts` ranks, the first ranks one more when it does not divide."""
    base, extra = divmod(length, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def take_piece(x: torch.Tensor, dim: int, sizes: list[int], index: int) -> torch.Tensor:
    start = sum(sizes[:index])
    return x.narrow(dim, start, sizes[index])


def gather_pieces(x: torch.Tensor, dim: int, sizes: list[int], group, index: int) -> torch.Tensor:
    """Concatenate every rank's piece along `dim` (rank order); piece i has sizes[i] there."""
    if x.shape[dim] != sizes[index]:
        raise RuntimeError(f"piece {index} has {x.shape[dim]} along dim {dim}, expected {sizes}")
    longest = max(sizes)
    pad = list(x.shape)
    pad[dim] = longest - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim=dim) if pad[dim] else x
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded.contiguous(), group=group)
    return torch.cat([o.narrow(dim, 0, n) for o, n in zip(out, sizes, strict=True)], dim=dim)


def seq_to_heads(x: torch.Tensor, seq_sizes: list[int], group, index: int) -> torch.Tensor:
    """[B, H, S_local, D] with this rank's tokens -> [B, H/U, S_all, D] with its heads.

    Head group j goes to rank j; the tokens come back in rank order (rank 0's piece first),
    a permutation of the true order that attention does not see as long as q, k, v and the
    key mask all use it.
    """
    u = len(seq_sizes)
    b, h, s, d = x.shape
    hu = h // u
    send = x.reshape(b, u, hu, s, d).transpose(0, 1).contiguous()  # [U, B, H/U, S_local, D]
    recv = x.new_empty(b * hu * sum(seq_sizes) * d)
    dist.all_to_all_single(
        recv,
        send.reshape(-1),
        output_split_sizes=[b * hu * n * d for n in seq_sizes],
        input_split_sizes=[b * hu * s * d] * u,
        group=group,
    )
    pieces = [
        p.view(b, hu, n, d)
        for p, n in zip(recv.split([b * hu * n * d for n in seq_sizes]), seq_sizes, strict=True)
    ]
    return torch.cat(pieces, dim=2)


def heads_to_seq(x: torch.Tensor, seq_sizes: list[int], group, index: int) -> torch.Tensor:
    """Inverse of `seq_to_heads`: [B, H/U, S_all, D] -> [B, H, S_local, D]."""
    u = len(seq_sizes)
    b, hu, _, d = x.shape
    s = seq_sizes[index]
    send = torch.cat([p.reshape(-1) for p in x.split(seq_sizes, dim=2)])
    recv = x.new_empty(u * b * hu * s * d)
    dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=[b * hu * s * d] * u,
        input_split_sizes=[b * hu * n * d for n in seq_sizes],
        group=group,
    )
    return recv.view(u, b, hu, s, d).transpose(0, 1).reshape(b, u * hu, s, d)
