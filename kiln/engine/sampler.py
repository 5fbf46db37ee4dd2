"""Picks the next token of each sequence from its logits."""

from __future__ import annotations

import torch

from kiln.engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [num_seqs, vocab] fp32 -> one token id per row, on logits' device.

    Greedy rows take the argmax. Other rows are scaled by temperature, cut to top-k and
    top-p, and sampled by the exponential race (argmax of p / E, E ~ Exp(1)), which draws
    from p with one random number per token; a seeded row draws its E from its own
    generator, so its tokens do not depend on what else is in the batch.

    Nothing here waits for the GPU (every host value goes up through pinned memory), so the
    engine can prepare its next step while this one runs.
    """
    tokens = _argmax(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        dev = logits.device
        index = to_device(rows, torch.long, dev)
        sub = logits.index_select(0, index) / to_device([params[i].temperature for i in rows], logits.dtype,
                                                         dev).unsqueeze(1)
        sub = _top_k(sub, [params[i].top_k for i in rows])
        sub = _top_p(sub, [params[i].top_p for i in rows])
        probs = sub.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for j, i in enumerate(rows):
            if generators[i] is not None:
                drawn = torch.empty(probs.shape[1], pin_memory=dev.type == "cuda").exponential_(generator=generators[i])
                noise[j].copy_(drawn, non_blocking=True)
        tokens.index_copy_(0, index, _argmax(probs / noise))
    return tokens


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first index of its largest value: torch's argmax, in one Triton launch on CUDA."""
    if x.device.type != "cuda":
        return x.argmax(dim=-1)
    from kiln.ops.triton.argmax import argmax

    return argmax(x)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on `device` without waiting for the GPU: a plain copy from pageable memory
    synchronises the stream; one from pinned memory is queued (torch keeps the staging alive
    until it has run)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def _top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    if all(k <= 0 for k in top_k):  # 0 and -1: off
        return logits
    vocab = logits.shape[1]
    k = to_device([vocab if k <= 0 else min(k, vocab) for k in top_k], torch.long, logits.device)
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in top_p):
        return logits
    p = to_device(top_p, logits.dtype, logits.device).unsqueeze(1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p; the top one stays.
    drop = (probs.cumsum(dim=-1) - probs) >= p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
