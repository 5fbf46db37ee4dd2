"""Log probabilities of chosen tokens and of the most likely ones, in vLLM's shape.

Values are the log-softmax of the model's fp32 logits before anything a request does to them
(penalties, bias, temperature, top-k/top-p), as vLLM reports by default; the chosen token is
always reported with its rank (1 = the most likely), whether or not it is among the top ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class TokenLogprobs:
    """For R rows: the chosen token's log probability and rank, and the `num` most likely tokens."""

    chosen: torch.Tensor  # [R] float
    ranks: torch.Tensor  # [R] long
    top_ids: torch.Tensor  # [R, num] long
    top_values: torch.Tensor  # [R, num] float

    @classmethod
    def of(cls, logits: torch.Tensor, tokens: torch.Tensor, num: int) -> "TokenLogprobs":
        """logits [R, vocab], tokens [R] (the chosen ones), num: how many of the most likely."""
        lp = logits.float().log_softmax(dim=-1)
        chosen = lp.gather(1, tokens.long().unsqueeze(1))
        ranks = (lp > chosen).sum(dim=-1) + 1
        top = lp.topk(num, dim=-1) if num else (lp[:, :0], torch.empty(lp.shape[0], 0, dtype=torch.long,
                                                                        device=lp.device))
        return cls(chosen.squeeze(1), ranks, top[1], top[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "TokenLogprobs":
        pin = non_blocking and torch.device(device).type == "cpu" and self.chosen.is_cuda

        def move(t: torch.Tensor) -> torch.Tensor:
            if not pin:
                return t.to(device)
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)

        return TokenLogprobs(move(self.chosen), move(self.ranks), move(self.top_ids), move(self.top_values))

    def row(self, i: int, token: int, num: int) -> dict[int, Logprob]:
        """Row i as vLLM's {token id: Logprob}: the chosen token first, then the top `num` (host tensors)."""
        entry = {token: Logprob(float(self.chosen[i]), int(self.ranks[i]))}
        for rank, (tid, value) in enumerate(zip(self.top_ids[i, :num].tolist(), self.top_values[i, :num].tolist()), 1):
            entry.setdefault(tid, Logprob(value, rank))
        return entry
