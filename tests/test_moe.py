"""kiln::fused_moe: the reference against a plain per-token loop, its errors, and the Triton path
(the interpreter on CPU) against the reference (its opcheck is in test_opcheck.py)."""

import pytest
import torch
import torch.nn.functional as F

from kiln.ops.moe import fused_moe, fused_moe_reference, route

triton = pytest.importorskip("triton")

from kiln.ops.triton.moe import fused_moe as triton_fused_moe, sort_by_expert  # noqa: E402


def _inputs(tokens, experts=8, hidden=64, inter=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, experts, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(dtype)
    return x, logits, w13, w2


def _per_token(x, logits, w13, w2, top_k, renormalize):
    probs = logits.float().softmax(-1)
    out = []
    for t in range(x.shape[0]):
        top = probs[t].topk(top_k)
        weights = top.values / top.values.sum() if renormalize else top.values
        y = 0
        for w, e in zip(weights, top.indices):
            gate, up = (w13[e] @ x[t]).chunk(2)
            y = y + w * (w2[e] @ (F.silu(gate) * up))
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("renormalize", [True, False])
def test_reference_is_the_routed_sum_of_expert_mlps(renormalize):
    x, logits, w13, w2 = _inputs(9)
    torch.testing.assert_close(fused_moe_reference(x, logits, w13, w2, 2, renormalize),
                               _per_token(x, logits, w13, w2, 2, renormalize), atol=1e-5, rtol=1e-5)


def test_route_renormalizes_the_top_probabilities():
    weights, ids = route(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), 2, renormalize=True)
    assert ids.tolist() == [[3, 2]] and torch.allclose(weights.sum(-1), torch.ones(1))
    weights, _ = route(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), 2, renormalize=False)
    assert weights.sum().item() < 0.95


def test_bad_shapes_are_named():
    x, logits, w13, w2 = _inputs(5)
    with pytest.raises(ValueError, match="router_logits"):
        fused_moe(x, logits[:, :4], w13, w2, 2, True)
    with pytest.raises(ValueError, match="top_k=9"):
        fused_moe(x, logits, w13, w2, 9, True)


@pytest.mark.parametrize("tokens, top_k, block_m", [(1, 2, 16), (13, 3, 16), (40, 2, 32)])
def test_sort_by_expert(tokens, top_k, block_m):
    _, logits, _, _ = _inputs(tokens)
    _, ids = route(logits, top_k, True)
    sorted_pairs, block_expert = sort_by_expert(ids, 8, block_m)
    pairs = tokens * top_k
    real = sorted_pairs[sorted_pairs < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair once
    flat = ids.flatten()
    for b, e in enumerate(block_expert.tolist()):
        block = sorted_pairs[b * block_m:(b + 1) * block_m]
        members = block[block < pairs].long()
        if e < 0:
            assert members.numel() == 0
        else:
            assert members.numel() > 0 and (flat[members] == e).all()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
@pytest.mark.parametrize("tokens, top_k, renormalize", [(1, 2, True), (7, 2, False), (37, 3, True)])
def test_triton_matches_reference(tokens, top_k, renormalize, dtype, tol):
    """fp32 and fp16 (the interpreter multiplies bf16 blocks as integers; bf16 is checked on the GPU)."""
    x, logits, w13, w2 = _inputs(tokens, dtype=dtype)
    expected = fused_moe_reference(x, logits, w13, w2, top_k, renormalize)
    for block_m in (None, 16):
        weights, ids = route(logits, top_k, renormalize)
        torch.testing.assert_close(triton_fused_moe(x, weights, ids, w13, w2, block_m=block_m), expected,
                                   atol=tol, rtol=tol)
