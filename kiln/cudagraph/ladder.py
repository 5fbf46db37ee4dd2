"""The bucket ladder and the padding table: which captured size a batch of n is padded to.

A step is padded up to the next captured bucket, so a handful of CUDA graphs serve every
batch size. Pure bookkeeping, no CUDA: tested on the CPU.
"""

from __future__ import annotations

import bisect

DEFAULT_MAX_CAPTURE_SIZE = 512


def capture_ladder(max_size: int) -> list[int]:
    """1, 2, 4, then steps of 8 to 256, then steps of 16, up to and including max_size."""
    return _up_to([1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max_size + 1, 16)), max_size)


def mixed_batch_ladder(max_size: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, then steps of 16 to 128, then the decode ladder's (8 to 256, 16
    after), up to and including max_size: the mixed-batch (prefill) phase's default buckets.

    Coarser below 128 because a mixed step is rare beside decode steps (one per prompt or
    chunk) while each of its buckets costs a capture, one per compiled piece in piecewise mode
    (19 buckets x 33 pieces were 0.8-0.9 s of an -O2 start on the H200; they are now captured
    on first use or while a server idles, PhaseGraphs.capture), and
    because up to 128 rows a step's GEMMs are bound by the weights' bytes, so padding adds
    little (H200, llama-3-8b: a layer's GEMMs at 64 rows 117 us, at 128 rows 131 us). Above
    128 they approach the compute bound, and the fine steps stay.
    """
    fine = [n for n in capture_ladder(max_size) if n > 128]
    return _up_to([1, 2, 4, 8, 16, 32, 48] + list(range(64, 129, 16)) + fine, max_size)


def _up_to(ladder: list[int], max_size: int) -> list[int]:
    sizes = sorted(n for n in set(ladder) if n <= max_size)
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
