"""A mixture-of-experts MLP on the GPU, given each token's experts and routing weights (kiln.ops.moe
routes): tokens sorted by expert, two grouped GEMMs.

Every step runs on the device with shapes fixed by the token count (no host sync, so it can be
captured in a CUDA graph): the (token, slot) pairs are sorted by expert and each expert's run
padded to whole BLOCK_M blocks; one program per block and column tile multiplies its pairs by
its expert's weights. The first GEMM gives each pair's [gate | up], SiLU-and-mul follows (the
same kernel as the dense MLP's), the second gives each pair's routing-weighted output, and
the pairs of a token are summed.
"""

from __future__ import annotations

import torch
import triton

from kiln.ops.triton.activation import silu_and_mul
from kiln.ops.triton.kernels.moe import moe_gemm_kernel
from kiln.ops.triton.launch import launch


def block_rows(num_pairs: int, num_experts: int) -> int:
    """BLOCK_M: small when each expert gets few pairs (decode), so padding wastes little."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert) for pairs = ids.flatten(): each expert's pairs, in order, from
    a multiple of block_m on; padding holds len(pairs). Sizes depend on the pair count alone."""
    flat = ids.flatten()
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    expert_of_sorted = flat[order]
    first_of_expert = counts.cumsum(0) - counts
    dest = (ends - padded)[expert_of_sorted] + torch.arange(pairs, device=flat.device) - first_of_expert[expert_of_sorted]
    capacity = pairs + num_experts * (block_m - 1)
    num_blocks = triton.cdiv(capacity, block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_pairs, block_expert


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, sorted_pairs: torch.Tensor,
                  block_expert: torch.Tensor, num_pairs: int, block_m: int, top_k_div: int,
                  weights: torch.Tensor | None) -> None:
    n, k = b.shape[1], b.shape[2]
    block_n, block_k = 64, 64
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    launch(moe_gemm_kernel, grid,
        a, b, out, weights if weights is not None else out, sorted_pairs, block_expert, num_pairs, n, k,
        a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        TOP_K_DIV=top_k_div, WEIGHTED=weights is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=4,
    )


def fused_moe(hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              block_m: int | None = None) -> torch.Tensor:
    """kiln::fused_moe on CUDA after routing (kiln.ops.moe states what it computes): weights [T, top_k]
    fp32 and ids [T, top_k] of each token's experts."""
    for name, t in (("hidden", hidden), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"fused_moe: {name}'s last dim must be contiguous, got strides {t.stride()}")
    tokens, num_experts = hidden.shape[0], w13.shape[0]
    if tokens == 0:
        return torch.empty_like(hidden)
    top_k = ids.shape[1]
    pairs = tokens * top_k
    block_m = block_m or block_rows(pairs, num_experts)
    sorted_pairs, block_expert = sort_by_expert(ids, num_experts, block_m)
    gate_up = torch.empty(pairs, w13.shape[1], dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, gate_up, sorted_pairs, block_expert, pairs, block_m, top_k, None)
    act = silu_and_mul(gate_up)
    out = torch.empty(pairs, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(act, w2, out, sorted_pairs, block_expert, pairs, block_m, 1, weights.flatten().contiguous())
    return out.view(tokens, top_k, -1).sum(dim=1)
