"""A mixture-of-experts MLP as one opaque op: routing and every expert's gated MLP.

    kiln::fused_moe(hidden [T, H], router_logits [T, E], w13 [E, 2I, H], w2 [E, H, I], top_k,
                    renormalize) -> [T, H]

Routing is a softmax over the experts in fp32 and the top_k largest probabilities (divided by
their sum when `renormalize`: Mixtral always, Qwen3-MoE as norm_topk_prob says). Each token's
output is the routing-weighted sum of its experts' silu(x W1^T) * (x W3^T) W2^T, w13 holding
[W1 | W3] of each expert along its rows.

Why an opaque op: which tokens go to which expert is data, and any Python over it would break
Dynamo's one capture; inside the op the CPU path loops over the experts (the reference) and
the CUDA path sorts tokens by expert on the device and runs two grouped GEMMs (kiln.ops.triton.moe).
Why not a split point: the op reads nothing from the forward context and its CUDA launches
have grids fixed by the token count, so a CUDA graph holds it like any other kernel and the
pieces around it stay whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.custom_op import kernel, kiln_op


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] fp32, expert ids [T, top_k]) of each token."""
    probs = router_logits.float().softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe_reference(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        top_k: int, renormalize: bool) -> torch.Tensor:
    """Expert by expert, in HF transformers' order: each expert's tokens through its MLP, weighted,
    added into the output in the hidden dtype."""
    weights, ids = route(router_logits, top_k, renormalize)
    out = torch.zeros_like(hidden)
    for expert in range(w13.shape[0]):
        token, slot = torch.where(ids == expert)
        if token.numel() == 0:
            continue
        gate, up = F.linear(hidden[token], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def _check(hidden, router_logits, w13, w2, top_k):
    experts, inter2, h = w13.shape
    if hidden.dim() != 2 or hidden.shape[1] != h:
        raise ValueError(f"fused_moe: hidden must be [tokens, {h}], got {tuple(hidden.shape)}")
    if router_logits.shape != (hidden.shape[0], experts):
        raise ValueError(f"fused_moe: router_logits must be [{hidden.shape[0]}, {experts}], "
                         f"got {tuple(router_logits.shape)}")
    if inter2 % 2 or tuple(w2.shape) != (experts, h, inter2 // 2):
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [E, 2I, H] and [E, H, I]")
    if not 0 < top_k <= experts:
        raise ValueError(f"fused_moe: top_k={top_k} must be between 1 and the {experts} experts")


@kiln_op("kiln::fused_moe", mutates_args=())
def fused_moe(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              top_k: int, renormalize: bool) -> torch.Tensor:
    _check(hidden, router_logits, w13, w2, top_k)
    return fused_moe_reference(hidden, router_logits, w13, w2, top_k, renormalize)


@fused_moe.register_fake
def _(hidden, router_logits, w13, w2, top_k, renormalize):
    return torch.empty_like(hidden)


@kernel(fused_moe, "cuda")
def _(hidden, router_logits, w13, w2, top_k, renormalize):
    from kiln.ops.triton.moe import fused_moe as triton_fused_moe

    _check(hidden, router_logits, w13, w2, top_k)
    weights, ids = route(router_logits, top_k, renormalize)
    return triton_fused_moe(hidden, weights, ids, w13, w2)
