"""Token shapes: what a piece is compiled for. A compile range [lo, hi] (the ranges partition
[1, max_num_batched_tokens]) or an exact compile size n; a call with n tokens takes the exact
size if there is one, else the range that contains n."""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenShape:
    lo: int
    hi: int

    @property
    def is_size(self) -> bool:
        return self.lo == self.hi

    def __str__(self) -> str:
        return f"size {self.lo}" if self.is_size else f"range [{self.lo}, {self.hi}]"


class ShapePlan:
    """The compile ranges and sizes for token counts in [1, max_tokens]."""

    def __init__(self, range_ends: list[int], sizes: list[int], max_tokens: int):
        self.ends = [e for e in range_ends if e < max_tokens] + [max_tokens]
        starts = [1] + [e + 1 for e in self.ends[:-1]]
        self.ranges = [TokenShape(lo, hi) for lo, hi in zip(starts, self.ends)]
        self.sizes = {n: TokenShape(n, n) for n in sizes if n <= max_tokens}
        self.max_tokens = max_tokens

    def shape_for(self, num_tokens: int) -> TokenShape:
        exact = self.sizes.get(num_tokens)
        if exact is not None:
            return exact
        if not 1 <= num_tokens <= self.max_tokens:
            raise ValueError(f"{num_tokens} tokens is outside [1, {self.max_tokens}] "
                             f"(max_num_batched_tokens) that the model was compiled for")
        return self.ranges[bisect.bisect_left(self.ends, num_tokens)]

    def all_shapes(self) -> list[TokenShape]:
        return self.ranges + list(self.sizes.values())


def size_hint(shape: TokenShape) -> int:
    """The token count Inductor tunes a shape for: a range's largest, the batches where speed
    matters most, whatever count the capture call had."""
    return shape.hi
