"""Picks the next token of each sequence from its logits.

The logits first go through what a request asks of them, in vLLM's order and with its
semantics: logit_bias is added; EOS and stop_token_ids are masked until min_tokens are out;
repetition_penalty divides positive logits (multiplies negative ones) of every token seen in
the prompt or output; frequency and presence penalties subtract per occurrence and once per
token of the output. Then greedy rows take the argmax; the others are scaled by temperature,
cut by min_p, top-k and top-p, and drawn: on the GPU by the exponential race (argmax of
p / E, E ~ Exp(1) a token), on the CPU by the running sum (one uniform draw a row); a seeded
row draws from its own generator, so its tokens do not depend on what else is in the batch.

Nothing here waits for the GPU (every host value goes up through pinned memory), so the
engine can prepare its next step while this one runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.engine.sampling_params import SamplingParams
from kiln.engine.structured_output import allowed_tokens


@dataclass
class RowHistory:
    """What min_tokens and the penalties read of one row's sequence."""

    prompt: list[int]
    output: list[int]  # output tokens known on the host
    pending: int | None  # its newest token, still on the device: an index into `in_flight`
    stop_ids: frozenset[int]  # EOS and stop_token_ids: masked while fewer than min_tokens are out

    @property
    def num_output(self) -> int:
        return len(self.output) + (self.pending is not None)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           history: list[RowHistory] | None = None, in_flight: torch.Tensor | None = None,
           allowed: torch.Tensor | None = None, greedy: torch.Tensor | None = None) -> torch.Tensor:
    """logits [num_seqs, vocab] fp32 -> one token id per row, on logits' device (a new tensor).
    `history` (one per row) is needed where a row has penalties or min_tokens; `in_flight` holds
    the tokens its `pending` indices point to; `allowed` (structured output) is a [num_seqs,
    vocab / 32] int32 bitmask of the tokens each row may take; `greedy`, if given, is
    greedy_tokens(logits), already computed (in a decode step's CUDA graph)."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed_tokens(allowed, logits.shape[1]), float("-inf"))
    controlled = apply_controls(logits, params, history, in_flight)
    if greedy is not None and controlled is logits and allowed is None:
        tokens = greedy.clone()  # the graph's output is overwritten by the next replay
    else:
        tokens = greedy_tokens(controlled)
    logits = controlled
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        dev = logits.device
        index = to_device(rows, torch.long, dev)
        scaled = logits.index_select(0, index) / to_device([params[i].temperature for i in rows], logits.dtype,
                                                            dev).unsqueeze(1)
        kept = kept_probs(scaled, [params[i].min_p for i in rows], [params[i].top_k for i in rows],
                          [params[i].top_p for i in rows])
        tokens.index_copy_(0, index, draw(kept, [(j, generators[i]) for j, i in enumerate(rows)
                                                 if generators[i] is not None]))
    return tokens


def needs_history(params: SamplingParams) -> bool:
    return params.has_penalties or params.min_tokens > 0


def apply_controls(logits: torch.Tensor, params: list[SamplingParams], history: list[RowHistory] | None,
                   in_flight: torch.Tensor | None) -> torch.Tensor:
    """The logits with each row's logit_bias, min_tokens and penalties applied (a new tensor
    where any applies)."""
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    masked = [i for i, p in enumerate(params) if p.min_tokens and history[i].num_output < p.min_tokens]
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    if not (biased or masked or penalised):
        return logits
    logits, dev = logits.clone(), logits.device
    if biased:
        rows = [i for i in biased for _ in params[i].logit_bias]
        ids = [t for i in biased for t in params[i].logit_bias]
        values = [v for i in biased for v in params[i].logit_bias.values()]
        logits.index_put_((to_device(rows, torch.long, dev), to_device(ids, torch.long, dev)),
                          to_device(values, logits.dtype, dev), accumulate=True)
    if masked:
        rows = [i for i in masked for _ in history[i].stop_ids]
        ids = [t for i in masked for t in history[i].stop_ids]
        if rows:
            logits.index_put_((to_device(rows, torch.long, dev), to_device(ids, torch.long, dev)),
                              torch.tensor(float("-inf"), device=dev))
    if penalised:
        _penalise(logits, penalised, params, history, in_flight)
    return logits


def _penalise(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], history: list[RowHistory],
              in_flight: torch.Tensor | None) -> None:
    dev, vocab = logits.device, logits.shape[1]
    index = to_device(rows, torch.long, dev)
    # Output counts per row, one column past the vocabulary for padding.
    width = max(len(history[i].output) for i in rows) + 1
    out = torch.full((len(rows), width), vocab, dtype=torch.long)
    for j, i in enumerate(rows):
        out[j, : len(history[i].output)] = torch.tensor(history[i].output, dtype=torch.long)
    out = out.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else out
    pending = [(j, history[i].pending) for j, i in enumerate(rows) if history[i].pending is not None]
    if pending:
        where = to_device([j for j, _ in pending], torch.long, dev)
        out[:, -1].index_copy_(0, where, in_flight.index_select(0, to_device([k for _, k in pending], torch.long, dev)))
    counts = torch.zeros(len(rows), vocab + 1, dtype=logits.dtype, device=dev)
    counts.scatter_add_(1, out, torch.ones_like(out, dtype=logits.dtype))
    counts = counts[:, :vocab]
    sub = logits.index_select(0, index)
    repeated = [params[i].repetition_penalty for i in rows]
    if any(r != 1 for r in repeated):
        width = max(len(history[i].prompt) for i in rows)
        prompt = torch.full((len(rows), width), vocab, dtype=torch.long)
        for j, i in enumerate(rows):
            prompt[j, : len(history[i].prompt)] = torch.tensor(history[i].prompt, dtype=torch.long)
        prompt = prompt.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else prompt
        seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=dev)
        seen.scatter_(1, prompt, True)
        seen = seen[:, :vocab] | (counts > 0)
        r = to_device(repeated, logits.dtype, dev).unsqueeze(1)
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    frequency = to_device([params[i].frequency_penalty for i in rows], logits.dtype, dev).unsqueeze(1)
    presence = to_device([params[i].presence_penalty for i in rows], logits.dtype, dev).unsqueeze(1)
    sub = sub - frequency * counts - presence * (counts > 0).to(logits.dtype)
    logits.index_copy_(0, index, sub)


def greedy_tokens(x: torch.Tensor) -> torch.Tensor:
    """Each row's first index of its largest value: torch's argmax, in one Triton launch on CUDA."""
    if x.device.type != "cuda":
        # max's indices are argmax's (the first maximum; a NaN wins), and on the CPU max is
        # vectorised: 16 x 49152 bf16 logits 285 us against 1,333 (2 threads).
        return x.max(dim=-1).indices
    from kiln.ops.triton.argmax import argmax

    return argmax(x)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on `device` without waiting for the GPU: a plain copy from pageable memory
    synchronises the stream; one from pinned memory is queued (torch keeps the staging alive
    until it has run)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


# Up to this top_k, the tokens top-p ranks are topk's picks; past it (or without top-k) the row is sorted.
TOP_K_SELECT_MAX = 1024


def kept_probs(x: torch.Tensor, min_p: list[float], top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Each row's probabilities (unnormalised: exp(x - max)) with the tokens min_p, top_k and top_p
    cut set to 0, in that order. min_p drops a token below min_p times the likeliest one's; top-k
    keeps the k largest and any tied with the k-th; top-p keeps a token while the tokens more likely
    than it hold less than top_p of what is left. Tied tokens stand or fall together, so every cut
    keeps the tokens at or above a threshold, and the order a sort gives equal values never matters."""
    dev, vocab = x.device, x.shape[1]
    top = x.amax(dim=-1, keepdim=True)
    e = (x - top).exp()
    floor = None
    if any(p > 0 for p in min_p):
        floor = to_device(min_p, x.dtype, dev).unsqueeze(1)
    tau = None  # the smallest logit kept, where top-k or top-p cuts
    ranked = None  # each row's largest logits, descending: all of them, or topk's picks
    if any(p < 1 for p in top_p) and not all(0 < k <= TOP_K_SELECT_MAX for k in top_k):
        ranked = x.sort(dim=-1, descending=True).values
    elif any(k > 0 for k in top_k):
        ranked = x.topk(min(max(top_k), vocab), dim=-1).values
    if any(k > 0 for k in top_k):
        kth = ranked.gather(1, to_device([min(max(k, 1), vocab) - 1 for k in top_k], torch.long, dev).unsqueeze(1))
        tau = torch.where(to_device([k > 0 for k in top_k], torch.bool, dev).unsqueeze(1), kth, float("-inf"))

    def cut(values: torch.Tensor, ev: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(values, dtype=torch.bool) if tau is None else values < tau
        return out if floor is None else out | (ev < floor)

    if any(p < 1 for p in top_p):
        left = e.masked_fill(cut(x, e), 0).sum(dim=-1, keepdim=True)
        ranked_e = (ranked - top).exp()
        share = ranked_e.masked_fill(cut(ranked, ranked_e), 0) / left
        p = to_device(top_p, x.dtype, dev).unsqueeze(1)
        # Kept: a prefix of the ranking (the top entry always). Its last logit is the threshold,
        # which keeps that logit's whole group of equals, as if ranked by the group's first entry.
        kept = (share.cumsum(dim=-1) - share < p) & (share > 0)
        last = ranked.gather(1, (kept.sum(dim=-1, keepdim=True) - 1).clamp(min=0))
        tau_p = torch.where(p < 1, last, float("-inf"))
        tau = tau_p if tau is None else torch.maximum(tau, tau_p)
    return e.masked_fill(cut(x, e), 0)


def draw(probs: torch.Tensor, seeded: list[tuple[int, torch.Generator]]) -> torch.Tensor:
    """One token per row of (unnormalised) probabilities; a seeded row's depends on its generator
    alone, never on the rest of the batch."""
    return _inverse_cdf(probs, seeded) if probs.device.type == "cpu" else race(probs, seeded)


def race(probs: torch.Tensor, seeded: list[tuple[int, torch.Generator]]) -> torch.Tensor:
    """The exponential race: argmax of p / E, E ~ Exp(1) a token. On the GPU the draws cost next to
    nothing and the argmax is one launch. A seeded row takes a seed from its own (host) generator
    and draws on the probabilities' device: no host draws of a vocabulary's length."""
    noise = torch.empty_like(probs).exponential_()
    for j, generator in seeded:
        noise[j].exponential_(generator=_device_generator(probs.device, draw_seed(generator)))
    return greedy_tokens(probs / noise)


def _inverse_cdf(probs: torch.Tensor, seeded: list[tuple[int, torch.Generator]]) -> torch.Tensor:
    """The first token whose running sum of probabilities passes u times the row's total, u ~ U[0, 1):
    one draw a row, where the CPU takes ~28 ns an Exp(1) draw (22 ms for 16 x 49,152). Summed in
    fp64 so that a token's share is exact to ~1e-16, not fp32's ~1e-7 at the end of the row."""
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64)
    for j, generator in seeded:
        u[j] = torch.rand(1, dtype=torch.float64, generator=generator)
    running = probs.double().cumsum(dim=-1)
    # The first sum strictly past u * total (< total for u < 1): never a token without a share.
    # Only a row of NaN (logits pushed to inf by a request's extreme penalties) finds none.
    picked = torch.searchsorted(running, u * running[:, -1:], right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[1] - 1)


def draw_seed(generator: torch.Generator) -> int:
    return int(torch.randint(2**62, (1,), generator=generator))


_generators: dict[torch.device, torch.Generator] = {}


def _device_generator(device: torch.device, seed: int) -> torch.Generator:
    if device not in _generators:
        _generators[device] = torch.Generator(device=device)
    return _generators[device].manual_seed(seed)
