"""Picks the next token of each sequence from its logits.

The logits first go through what a request asks of them, in vLLM's order and with its
semantics: logit_bias is added; EOS and stop_token_ids are masked until min_tokens are out;
repetition_penalty divides positive logits (multiplies negative ones) of every token seen in
the prompt or output; frequency and presence penalties subtract per occurrence and once per
token of the output. Then greedy rows take the argmax; the others are scaled by temperature,
cut by min_p, top-k and top-p (each cut a threshold on the logits), and drawn: on the GPU by
Gumbel-max in one launch, on the CPU by the running sum (one uniform draw a row); a seeded row
draws from its own generator, so its tokens do not depend on what else is in the batch.

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
        threshold = cut_threshold(scaled, [params[i].min_p for i in rows], [params[i].top_k for i in rows],
                                  [params[i].top_p for i in rows])
        tokens.index_copy_(0, index, draw(scaled, threshold, [generators[i] for i in rows]))
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


def cut_threshold(x: torch.Tensor, min_p: list[float], top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """[rows, 1]: each row's smallest kept logit (-inf: all) after min_p, top_k and top_p, in that
    order. min_p drops a token below min_p times the likeliest one's probability; top-k keeps the k
    largest and any tied with the k-th; top-p keeps a token while the tokens more likely than it
    hold less than top_p of what is left. Tied tokens stand or fall together, so every cut keeps
    the tokens at or above a threshold, and the order a sort gives equal values never matters."""
    dev, vocab = x.device, x.shape[1]
    top = x.amax(dim=-1, keepdim=True)
    tau = torch.full_like(top, float("-inf"))
    if any(p > 0 for p in min_p):  # p >= min_p * p_max  <=>  x >= max + log(min_p)
        tau = top + to_device(min_p, x.dtype, dev).unsqueeze(1).log()
    ranked = None  # each row's largest logits, descending: all of them, or topk's picks
    if any(p < 1 for p in top_p) and not all(0 < k <= TOP_K_SELECT_MAX for k in top_k):
        ranked = x.sort(dim=-1, descending=True).values
    elif any(k > 0 for k in top_k):
        ranked = x.topk(min(max(top_k), vocab), dim=-1).values
    if any(k > 0 for k in top_k):
        kth = ranked.gather(1, to_device([min(max(k, 1), vocab) - 1 for k in top_k], torch.long, dev).unsqueeze(1))
        tau = torch.maximum(tau, torch.where(to_device([k > 0 for k in top_k], torch.bool, dev).unsqueeze(1), kth,
                                             float("-inf")))
    if any(p < 1 for p in top_p):
        left = (x - top).exp().masked_fill(x < tau, 0).sum(dim=-1, keepdim=True)
        share = (ranked - top).exp().masked_fill(ranked < tau, 0) / left
        p = to_device(top_p, x.dtype, dev).unsqueeze(1)
        # Kept: a prefix of the ranking (the top entry always). Its last logit is the threshold,
        # which keeps that logit's whole group of equals, as if ranked by the group's first entry.
        kept = (share.cumsum(dim=-1) - share < p) & (share > 0)
        last = ranked.gather(1, (kept.sum(dim=-1, keepdim=True) - 1).clamp(min=0))
        tau = torch.maximum(tau, torch.where(p < 1, last, float("-inf")))
    return tau


def draw(x: torch.Tensor, threshold: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row from softmax(x) over the logits at or above the row's threshold; a row
    with a generator draws from it alone, so its token does not depend on the rest of the batch
    (but for torch summing a row in another order at another batch size, which moves a top-p
    boundary that lies within rounding of a running sum)."""
    if x.device.type == "cpu":
        top = x.amax(dim=-1, keepdim=True)  # NaN where the row holds one
        drawn = _inverse_cdf((x - top).exp().masked_fill(x < threshold, 0), generators)
        # A row of -inf, or one holding inf or NaN, has no probabilities: it takes its argmax, as on the GPU.
        broken = ~top.squeeze(1).isfinite()
        return torch.where(broken, greedy_tokens(x), drawn) if broken.any() else drawn
    return gumbel(x, threshold, generators)


def gumbel(x: torch.Tensor, threshold: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Gumbel-max in one Triton launch (kiln.ops.triton.argmax): the noise is Philox at (the row's
    seed, the column), so a GPU step draws nothing on the host but a seed a row: one from the row's
    own generator, or a fresh one."""
    from kiln.ops.triton.argmax import gumbel_argmax

    seeds = [_draw_seed(g) if g is not None else None for g in generators]
    if any(s is None for s in seeds):
        fresh = torch.randint(2**62, (len(seeds),)).tolist()
        seeds = [f if s is None else s for s, f in zip(seeds, fresh)]
    return gumbel_argmax(x.contiguous(), threshold.reshape(-1), to_device(seeds, torch.long, x.device))


def _inverse_cdf(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """The first token whose running sum of probabilities passes u times the row's total, u ~ U[0, 1):
    one draw a row, where the CPU takes ~28 ns an Exp(1) draw (22 ms for 16 x 49,152). Summed in
    fp64 so that a token's share is exact to ~1e-16, not fp32's ~1e-7 at the end of the row."""
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64)
    for j, generator in enumerate(generators):
        if generator is not None:
            u[j] = torch.rand(1, dtype=torch.float64, generator=generator)
    running = probs.double().cumsum(dim=-1)
    # The first sum strictly past u * total (< total for u < 1): never a token without a share.
    return torch.searchsorted(running, u * running[:, -1:], right=True).squeeze(1)


def _draw_seed(generator: torch.Generator) -> int:
    return int(torch.randint(2**62, (1,), generator=generator))
