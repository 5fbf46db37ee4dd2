"""The bucket ladder and the padding table: which captured size a batch of n is padded to.

A step is padded up to the next captured bucket, so a handful of CUDA graphs serve every
batch size. Pure bookkeeping, no CUDA: tested on the CPU.
"""

from __future__ import annotations

import bisect

DEFAULT_MAX_CAPTURE_SIZE = 512


def capture_ladder(max_size: int) -> list[int]:
    """1, 2, 4, then steps of 8 to 256, then steps of 16, up to and including max_size."""
    ladder = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max_size + 1, 16))
    sizes = [n for n in ladder if n <= max_size]
    if sizes[-1] != max_size:
        sizes.append(max_size)  # so every batch up to the max has a bucket
    return sizes


class BucketTable:
    """bucket_for(n): the smallest captured size >= n, looked up in a precomputed table."""

    def __init__(self, sizes: list[int]):
        self.sizes = sorted(set(sizes))
        top = self.sizes[-1] if self.sizes else 0
        self._table = [None] + [self.sizes[bisect.bisect_left(self.sizes, n)] for n in range(1, top + 1)]

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def bucket_for(self, n: int) -> int | None:
        return self._table[n] if 0 < n < len(self._table) else None
