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
    """What min_tokens, bad_words and the penalties read of one row's sequence."""

    prompt: list[int]
    output: list[int]  # output tokens known on the host
    pending: int | None  # its newest token, still on the device: an index into `in_flight`
    stop_ids: frozenset[int]  # EOS and stop_token_ids: masked while fewer than min_tokens are out
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences whose last token is masked after the rest

    @property
    def num_output(self) -> int:
        return len(self.output) + (self.pending is not None)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           history: list[RowHistory] | None = None, in_flight: torch.Tensor | None = None,
           allowed: torch.Tensor | None = None, greedy: torch.Tensor | None = None) -> torch.Tensor:
    """logits [num_seqs, vocab] -> one token id per row, on logits' device (a new tensor). The
    logits are fp32, or in the model's dtype where their `.float()` is the logits (a decode
    graph's head: decode_head), cast here only if read. `history` (one per row) is needed where
    a row has penalties or min_tokens; `in_flight` holds the tokens its `pending` indices point
    to; `allowed` (structured output) is a [num_seqs, vocab / 32] int32 bitmask of the tokens
    each row may take; `greedy`, if given, is greedy_tokens(logits), already computed (in a
    decode step's CUDA graph)."""
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if greedy is not None and not rows and allowed is None and not any(_controlled_rows(params, history)):
        return greedy.clone()  # the graph's output is overwritten by the next replay
    logits = logits.float()
    if allowed is not None:
        logits = logits.masked_fill(~allowed_tokens(allowed, logits.shape[1]), float("-inf"))
    controlled = apply_controls(logits, params, history, in_flight)
    if greedy is not None and controlled is logits and allowed is None:
        tokens = greedy.clone()  # the graph's output is overwritten by the next replay
    elif len(rows) < len(params):
        tokens = greedy_tokens(controlled)
    else:  # every row samples: no argmax to take
        tokens = torch.empty(len(params), dtype=torch.long, device=controlled.device)
    logits = controlled
    if rows:
        dev = logits.device
        chosen = [params[i] for i in rows]
        gens = [generators[i] for i in rows]
        index = to_device(rows, torch.long, dev)
        temperature, min_p, top_p, top_k, _ = host_to(settings_of(chosen), dev).unsqueeze(-1)
        x = logits if len(rows) == len(params) else logits.index_select(0, index)
        drawn = None
        if dev.type == "cpu" and all(p.top_k > 0 or p.top_p < 1 for p in chosen):
            drawn = draw_from_picks(x, chosen, temperature, min_p, top_k, top_p, gens)
        if drawn is None:
            if dev.type != "cuda":  # the CPU's draw reads the scaled logits: scale them once
                x, temperature = x / temperature, None
            threshold = cut_threshold(x, Cuts.of(chosen, dev), temperature, min_p, top_k, top_p)
            drawn = draw(x, temperature, threshold, gens)
        tokens.index_copy_(0, index, drawn)
    return tokens


def needs_history(params: SamplingParams) -> bool:
    return params.has_penalties or params.min_tokens > 0 or bool(params.bad_words)


def plain(params: SamplingParams) -> bool:
    """Whether a row's logits go to the cuts as the model made them (no allowed_token_ids,
    logit_bias, bad_words, penalties or min_tokens): what a fixed program, such as a CUDA graph's,
    can sample."""
    return not params.logit_bias and not params.allowed_token_ids and not needs_history(params)


def _controlled_rows(params: list[SamplingParams], history: list[RowHistory] | None) -> tuple[list[int], ...]:
    """The rows apply_controls changes: (allowed_token_ids, logit_bias, min_tokens not yet reached,
    penalties, bad_words)."""
    return ([i for i, p in enumerate(params) if p.allowed_token_ids],
            [i for i, p in enumerate(params) if p.logit_bias],
            [i for i, p in enumerate(params) if p.min_tokens and history[i].num_output < p.min_tokens],
            [i for i, p in enumerate(params) if p.has_penalties],
            [i for i, p in enumerate(params) if p.bad_words])


def apply_controls(logits: torch.Tensor, params: list[SamplingParams], history: list[RowHistory] | None,
                   in_flight: torch.Tensor | None) -> torch.Tensor:
    """The logits with each row's allowed_token_ids, logit_bias, min_tokens, bad_words and penalties
    applied (a new tensor where any applies)."""
    restricted, biased, masked, penalised, banned = _controlled_rows(params, history)
    if not (restricted or biased or masked or penalised or banned):
        return logits
    logits, dev = logits.clone(), logits.device
    if restricted:  # every token but the allowed ones at -inf
        # Up by (row, token) pairs, not as a [rows, vocab] mask: a few ids a row is the usual case.
        rows = to_device([i for i in restricted for _ in params[i].allowed_token_ids], torch.long, dev)
        ids = to_device([t for i in restricted for t in params[i].allowed_token_ids], torch.long, dev)
        allowed_logits = logits[rows, ids]
        logits.index_fill_(0, to_device(restricted, torch.long, dev), float("-inf"))
        logits.index_put_((rows, ids), allowed_logits)
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
    if banned:
        _ban_words(logits, [(i, history[i]) for i in banned], in_flight)
    return logits


def _ban_words(logits: torch.Tensor, rows: list[tuple[int, RowHistory]], in_flight: torch.Tensor | None) -> None:
    """-inf for each bad word's last token where the row's output ends with the rest of the word.
    A pending token (still on the device) is compared there: the mask then holds where it matches."""
    always, given = [], []  # (row, token); (row, token, pending index, the token pending must be)
    for i, h in rows:
        for word in h.bad_words:
            before = word[:-1]
            if h.pending is None or not before:
                if len(h.output) >= len(before) and tuple(h.output[len(h.output) - len(before):]) == before:
                    always.append((i, word[-1]))
            elif len(h.output) >= len(before) - 1 and tuple(h.output[len(h.output) - len(before) + 1:]) == before[:-1]:
                given.append((i, word[-1], h.pending, before[-1]))
    dev = logits.device
    if always:
        logits.index_put_((to_device([r for r, _ in always], torch.long, dev),
                           to_device([t for _, t in always], torch.long, dev)), torch.tensor(float("-inf"), device=dev))
    if given:
        # Two words may end in the same token after different pending ones: a logit is banned where any matches.
        keys = list(dict.fromkeys((r, t) for r, t, *_ in given))
        which = to_device([keys.index((r, t)) for r, t, *_ in given], torch.long, dev)
        pending = in_flight.index_select(0, to_device([p for *_, p, _ in given], torch.long, dev))
        matches = (pending == to_device([m for *_, m in given], torch.long, dev)).int()
        banned = torch.zeros(len(keys), dtype=torch.int, device=dev).scatter_reduce_(0, which, matches, "amax")
        where = (to_device([r for r, _ in keys], torch.long, dev), to_device([t for _, t in keys], torch.long, dev))
        logits.index_put_(where, torch.where(banned > 0, float("-inf"), logits[where]))


def _penalise(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], history: list[RowHistory],
              in_flight: torch.Tensor | None) -> None:
    dev, vocab = logits.device, logits.shape[1]
    index = to_device(rows, torch.long, dev)
    # Output counts per row, one column past the vocabulary for padding.
    width = max(len(history[i].output) for i in rows) + 1
    out = torch.full((len(rows), width), vocab, dtype=torch.long)
    for j, i in enumerate(rows):
        out[j, : len(history[i].output)] = torch.tensor(history[i].output, dtype=torch.long)
    out = host_to(out, dev)
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
        prompt = host_to(prompt, dev)
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


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor ready for a queued copy to `device` (pinned where that is a GPU)."""
    return t.pin_memory() if device.type == "cuda" else t


def host_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` by a queued copy (the tensor itself where that is the CPU)."""
    return pinned(t, device).to(device, non_blocking=True)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on `device` without waiting for the GPU: a plain copy from pageable memory
    synchronises the stream; one from pinned memory is queued (torch keeps the staging alive
    until it has run)."""
    return host_to(torch.tensor(values, dtype=dtype), device)


# Up to this top_k, the tokens top-p ranks are topk's picks; past it (or without top-k) the row is sorted.
TOP_K_SELECT_MAX = 1024
# settings_of's top_k at most (fp32 holds it exactly; any k past the vocabulary keeps every token): a
# larger one (e.g. 2**63 - 1) became INT64_MIN through fp32 and indexed out of bounds.
TOP_K_HELD_MAX = 2**24
# What settings_of holds for each row, in this order.
SETTINGS = ("temperature", "min_p", "top_p", "top_k", "greedy")


def settings_of(params: list[SamplingParams]) -> torch.Tensor:
    """[len(SETTINGS), rows] fp32 on the host. A greedy row holds the values that cut nothing
    (temperature 1, min_p 0, top_p 1, top_k 0) and greedy 1; top_k is 0 where off (fp32 holds it
    exactly)."""
    return torch.tensor([[1.0, 0.0, 1.0, 0.0, 1.0] if p.greedy else
                         [p.temperature, p.min_p, p.top_p, min(max(p.top_k, 0), TOP_K_HELD_MAX), 0.0] for p in params],
                        dtype=torch.float32).reshape(-1, len(SETTINGS)).T.contiguous()


@dataclass(frozen=True)
class Cuts:
    """The cuts a batch's sampled rows go through, and how they are ranked: one program for every
    row (a row a cut does not apply to holds the value that keeps every token), so a CUDA graph
    captured for one batch's Cuts samples any other batch with the same."""

    min_p: bool
    top_k: bool
    top_p: bool
    sort: bool  # rank whole rows
    picks: int  # otherwise, where top-k or top-p applies: how many largest logits topk ranks

    @classmethod
    def of(cls, params: list[SamplingParams], device: torch.device) -> "Cuts":
        """Of the batch's sampled rows (a greedy row cuts nothing). On the GPU topk always picks
        TOP_K_SELECT_MAX: its cost hardly moves with k (b256: topk 50 0.48 ms, 1024 0.50 on the
        H200), and one width keeps a graph's program the same for every k; the CPU's grows with k
        (b16 x 49,152: 5.5 -> 14.8 ms), so it picks the batch's largest k."""
        params = [p for p in params if not p.greedy]
        top_k, top_p = any(p.top_k > 0 for p in params), any(p.top_p < 1 for p in params)
        # A row whose top-p may reach past the picks, or (at the GPU's fixed width) whose k does.
        sort = any(p.top_p < 1 and not 0 < p.top_k <= TOP_K_SELECT_MAX for p in params) or \
            (device.type == "cuda" and any(p.top_k > TOP_K_SELECT_MAX for p in params))
        picks = 0 if sort or not (top_k or top_p) else \
            TOP_K_SELECT_MAX if device.type == "cuda" else max(p.top_k for p in params)
        return cls(min_p=any(p.min_p > 0 for p in params), top_k=top_k, top_p=top_p, sort=sort, picks=picks)


def cut_threshold(x: torch.Tensor, cuts: Cuts, temperature: torch.Tensor | None, min_p: torch.Tensor,
                  top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: each row's smallest kept logit (-inf: all) of x / temperature (None: x is scaled)
    after min_p, top_k and top_p ([rows, 1] each, on x's device), in that order. min_p drops a
    token below min_p times the likeliest one's probability; top-k keeps the k largest and any
    tied with the k-th; top-p keeps a token while the tokens more likely than it hold less than
    top_p of what is left. Tied tokens stand or fall together, so every cut keeps the tokens at
    or above a threshold, and the order a sort gives equal values never matters. Nothing here
    depends on the values but through tensors: the same launches for every batch with these
    `cuts`. The scaled rows are never written out: dividing by a positive temperature keeps the
    order, so x's ranking divided is the scaled ranking, value for value."""
    ranked = None  # each row's largest scaled logits, descending: all of them, or topk's picks
    if cuts.sort:
        ranked = _scaled(x.sort(dim=-1, descending=True).values, temperature)
    elif cuts.picks:
        ranked = _scaled(x.topk(min(cuts.picks, x.shape[1]), dim=-1).values, temperature)
    top = ranked[:, :1] if ranked is not None else _scaled(x.amax(dim=-1, keepdim=True), temperature)
    # What the cuts before top-p left: the sorted row's own sum; beyond topk's picks the whole row's.
    if cuts.sort:
        return cuts_on(ranked, top, cuts, min_p, top_k, top_p, lambda weight, tau: weight.sum(dim=-1, keepdim=True))
    return cuts_on(ranked, top, cuts, min_p, top_k, top_p, lambda weight, tau: kept_mass(x, temperature, top, tau))


def cuts_on(ranked: torch.Tensor | None, top: torch.Tensor, cuts: Cuts, min_p: torch.Tensor, top_k: torch.Tensor,
            top_p: torch.Tensor, mass) -> torch.Tensor:
    """cut_threshold's thresholds from each row's ranking (its largest scaled logits, descending;
    None where no cut reads one) and largest scaled logit `top` ([rows, 1]); mass(weight, tau) ->
    [rows, 1]: what min_p and top-k left of the whole row, given the ranking's weights and that
    threshold."""
    tau = torch.full_like(top, float("-inf"))
    if cuts.min_p:  # p >= min_p * p_max  <=>  x >= max + log(min_p); log(0) = -inf keeps all
        tau = top + min_p.log()
    if cuts.top_k:
        k = top_k.long()
        kth = ranked.gather(1, k.clamp(1, ranked.shape[1]) - 1)
        tau = torch.maximum(tau, torch.where(k > 0, kth, float("-inf")))
    if cuts.top_p:
        weight = (ranked - top).exp().masked_fill(ranked < tau, 0)
        share = weight / mass(weight, tau)
        # Kept: a prefix of the ranking (the top entry always). Its last logit is the threshold,
        # which keeps that logit's whole group of equals, as if ranked by the group's first entry.
        kept = (share.cumsum(dim=-1) - share < top_p) & (share > 0)
        last = ranked.gather(1, (kept.sum(dim=-1, keepdim=True) - 1).clamp(min=0))
        tau = torch.maximum(tau, torch.where(top_p < 1, last, float("-inf")))
    # A row holding inf or NaN (a broken model) gets NaN from the arithmetic above, which would
    # keep nothing (the draw's first column); it cuts nothing, and the draw takes its argmax.
    return tau.masked_fill(tau.isnan(), float("-inf"))


def _scaled(x: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    return x if temperature is None else x / temperature


def kept_mass(x: torch.Tensor, temperature: torch.Tensor | None, top: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: the sum of exp(s - top) over each row's scaled logits s = x / temperature at or
    above tau; one Triton read of x on the GPU (kiln.ops.triton.kept_mass)."""
    if x.device.type == "cuda":
        from kiln.ops.triton.kept_mass import kept_mass as kept_mass_launch

        return kept_mass_launch(x, temperature if temperature is not None else torch.ones_like(top), top, tau)
    s = _scaled(x, temperature)
    return (s - top).exp().masked_fill(s < tau, 0).sum(dim=-1, keepdim=True)


def largest_cuts(logits: torch.Tensor) -> torch.Tensor:
    """The cuts at their most on `logits` (every cut on, whole rows sorted): for a memory profile,
    whose step must hold the largest temporaries sampling makes (at 256 rows of a 128k vocabulary
    some hundreds of MB). Torch ops only: nothing compiles."""
    params = [SamplingParams(min_p=0.01, top_k=TOP_K_SELECT_MAX + 1, top_p=0.9)] * logits.shape[0]
    temperature, min_p, top_p, top_k, _ = host_to(settings_of(params), logits.device).unsqueeze(-1)
    cuts = Cuts(min_p=True, top_k=True, top_p=True, sort=True, picks=0)
    return cut_threshold(logits, cuts, temperature, min_p, top_k, top_p)


def sample_rows(logits: torch.Tensor, greedy: torch.Tensor, settings: torch.Tensor, seeds: torch.Tensor,
                cuts: Cuts) -> torch.Tensor:
    """A whole batch sampled on the GPU with no host value but through tensors (what a decode
    step's sampling CUDA graph captures): logits [rows, vocab] fp32 or as sample() takes them,
    greedy [rows] their argmax, settings [len(SETTINGS), rows] (settings_of, on the device), seeds
    [rows] int64 (seeds_of; any value for a greedy row) -> int64 [rows]. A row's token is what
    sample() draws for it with the same seed, but for rounding: its sums run over this batch's
    rows, not only the sampled."""
    from kiln.ops.triton.argmax import gumbel_argmax

    temperature, min_p, top_p, top_k, is_greedy = settings.unsqueeze(-1)
    logits = logits.float()
    threshold = cut_threshold(logits, cuts, temperature, min_p, top_k, top_p)
    drawn = gumbel_argmax(logits, threshold.reshape(-1), seeds, temperature.reshape(-1))
    return torch.where(is_greedy.squeeze(1) > 0, greedy, drawn)


def draw(x: torch.Tensor, temperature: torch.Tensor | None, threshold: torch.Tensor,
         generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row from softmax(x / temperature) (None: x is scaled) over the scaled logits
    at or above the row's threshold; a row with a generator draws from it alone, so its token does
    not depend on the rest of the batch (but for torch summing a row in another order at another
    batch size, which moves a top-p boundary that lies within rounding of a running sum)."""
    if x.device.type == "cpu":
        return _draw_whole_rows(_scaled(x, temperature), threshold, _uniforms(generators))
    return gumbel(x, temperature, threshold, generators)


def _draw_whole_rows(x: torch.Tensor, threshold: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The CPU's draw over whole rows of scaled logits, a uniform `u` a row (_uniforms)."""
    top = x.amax(dim=-1, keepdim=True)  # NaN where the row holds one
    drawn = _inverse_cdf((x - top).exp().masked_fill(x < threshold, 0), u)
    # A row of -inf, or one holding inf or NaN, has no probabilities: it takes its argmax, as on the GPU.
    broken = ~top.squeeze(1).isfinite()
    return torch.where(broken, greedy_tokens(x), drawn) if broken.any() else drawn


# draw_from_picks ranks this many logits past a batch's largest top_k (rounded up to a multiple of
# PICKS_MULTIPLE), to see that no token tied with a k-th lies beyond them; at least TOP_P_PICKS
# where a row has top-p and no top-k (a model's top-p 0.95 rarely reaches that far).
PICKS_SLACK = 32
TOP_P_PICKS = 256
# torch's CPU exp takes a scalar path for a loop's last partial vectors: candidate rows a multiple of
# this long are computed vector by vector, as whole vocabulary rows are, so every weight is the same.
PICKS_MULTIPLE = 64


def draw_from_picks(x: torch.Tensor, params: list[SamplingParams], temperature: torch.Tensor, min_p: torch.Tensor,
                    top_k: torch.Tensor, top_p: torch.Tensor,
                    generators: list[torch.Generator | None]) -> torch.Tensor:
    """The CPU's draw for a batch whose every row has a top-k or a top-p, from each row's largest
    logits alone: the tokens draw() gives over whole rows (the same weights, the same running sums
    in vocabulary order, the same uniforms; top-p's normaliser summed in another order, so a
    boundary within fp32 rounding of it may fall otherwise), at 16 x 49,152 ~1-3 ms against ~8
    (top-k) or ~35 (top-p alone: a sort) of passes over whole rows. A row whose kept tokens may
    reach past its picks, or that holds inf or NaN, is drawn over its whole row, with its own
    uniform all the same."""
    all_k = all(p.top_k > 0 for p in params)
    wanted = max([p.top_k + PICKS_SLACK for p in params if p.top_k > 0] + [0 if all_k else TOP_P_PICKS])
    width = min(x.shape[1], -(-wanted // PICKS_MULTIPLE) * PICKS_MULTIPLE)
    values, ids = x.topk(width, dim=-1)
    scaled = values / temperature
    top = scaled[:, :1]
    cuts = Cuts(min_p=any(p.min_p > 0 for p in params), top_k=any(p.top_k > 0 for p in params),
                top_p=any(p.top_p < 1 for p in params), sort=False, picks=width)
    if all_k:
        # Past the picks every logit is at most the last pick's: below each row's k-th, none is
        # kept, nor weighs in top-p's normaliser (what min_p and top-k kept), the picks' own sum.
        bound = scaled.gather(1, top_k.long().clamp(max=width) - 1)
        tau = cuts_on(scaled, top, cuts, min_p, top_k, top_p, lambda weight, tau: weight.sum(dim=-1, keepdim=True))
    else:  # top-p's normaliser is the whole row's; only the kept tokens must lie within the picks
        tau = cuts_on(scaled, top, cuts, min_p, top_k, top_p, lambda weight, tau: kept_mass(x, temperature, top, tau))
        bound = tau
    whole = ~top.squeeze(1).isfinite()
    if width < x.shape[1]:
        whole |= (scaled[:, -1:] >= bound).squeeze(1)
    u = _uniforms(generators)
    tokens = torch.zeros(len(params), dtype=torch.long)
    rows = (~whole).nonzero().squeeze(1)
    if rows.numel():
        ids, scaled, tau = (t.index_select(0, rows) for t in (ids, scaled, tau))
        weights = (scaled - scaled[:, :1]).exp().masked_fill(scaled < tau, 0)
        order = ids.argsort(dim=-1)  # the running sum goes in vocabulary order, as over a whole row
        chosen = _inverse_cdf(weights.gather(1, order), u.index_select(0, rows)).unsqueeze(1)
        tokens.index_copy_(0, rows, ids.gather(1, order).gather(1, chosen).squeeze(1))
    redo = whole.nonzero().squeeze(1)
    if redo.numel():
        xs = x.index_select(0, redo) / temperature.index_select(0, redo)
        threshold = cut_threshold(xs, Cuts.of([params[i] for i in redo.tolist()], x.device), None,
                                  *(t.index_select(0, redo) for t in (min_p, top_k, top_p)))
        tokens.index_copy_(0, redo, _draw_whole_rows(xs, threshold, u.index_select(0, redo)))
    return tokens


def gumbel(x: torch.Tensor, temperature: torch.Tensor | None, threshold: torch.Tensor,
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """Gumbel-max in one Triton launch (kiln.ops.triton.argmax): the noise is Philox at (the row's
    seed, the column), so a GPU step draws nothing on the host but a seed a row: one from the row's
    own generator, or a fresh one."""
    from kiln.ops.triton.argmax import gumbel_argmax

    return gumbel_argmax(x.contiguous(), threshold.reshape(-1), to_device(seeds_of(generators), torch.long, x.device),
                         temperature.reshape(-1) if temperature is not None else None)


def seeds_of(generators: list[torch.Generator | None]) -> list[int]:
    """One Philox seed a sampled row: drawn from the row's own generator, or from the host's."""
    seeds = [_draw_seed(g) if g is not None else None for g in generators]
    if any(s is None for s in seeds):
        fresh = torch.randint(2**62, (len(seeds),)).tolist()
        seeds = [f if s is None else s for s, f in zip(seeds, fresh)]
    return seeds


def _uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """[rows, 1] fp64 uniforms: a row with a generator draws from it alone."""
    u = torch.rand(len(generators), 1, dtype=torch.float64)
    for j, generator in enumerate(generators):
        if generator is not None:
            u[j] = torch.rand(1, dtype=torch.float64, generator=generator)
    return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first token whose running sum of probabilities passes u times the row's total, u ~ U[0, 1)
    ([rows, 1]): one draw a row, where the CPU takes ~28 ns an Exp(1) draw (22 ms for 16 x 49,152).
    Summed in fp64 so that a token's share is exact to ~1e-16, not fp32's ~1e-7 at the end of the row."""
    running = probs.double().cumsum(dim=-1)
    # The first sum strictly past u * total (< total for u < 1): never a token without a share.
    return torch.searchsorted(running, u * running[:, -1:], right=True).squeeze(1)


def _draw_seed(generator: torch.Generator) -> int:
    return int(torch.randint(2**62, (1,), generator=generator))
