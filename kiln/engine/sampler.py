"""Picks the next token of each sequence from its logits."""

from __future__ import annotations

import torch

from kiln.engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits [num_seqs, vocab] fp32 -> one token id per row.

    Greedy rows take the argmax. Other rows are scaled by temperature, cut to top-k and
    top-p, and sampled by the exponential race (argmax of p / E, E ~ Exp(1)), which draws
    from p with one random number per token; a seeded row draws its E from its own
    generator, so its tokens do not depend on what else is in the batch.
    """
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        sub = logits[rows] / torch.tensor([params[i].temperature for i in rows],
                                          device=logits.device).unsqueeze(1)
        sub = _top_k(sub, [params[i].top_k for i in rows])
        sub = _top_p(sub, [params[i].top_p for i in rows])
        probs = sub.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for j, i in enumerate(rows):
            if generators[i] is not None:
                noise[j] = torch.empty(probs.shape[1]).exponential_(generator=generators[i])
        tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens.tolist()


def _top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    if all(k <= 0 for k in top_k):  # 0 and -1: off
        return logits
    vocab = logits.shape[1]
    k = torch.tensor([vocab if k <= 0 else min(k, vocab) for k in top_k], device=logits.device)
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in top_p):
        return logits
    p = torch.tensor(top_p, device=logits.device).unsqueeze(1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p; the top one stays.
    drop = (probs.cumsum(dim=-1) - probs) >= p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
