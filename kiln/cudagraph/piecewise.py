"""Piecewise CUDA graphs: one graph per (compiled piece, bucket), attention eager between them.

The compiled forward's split graph runs as usual; it routes each piece call through the
wrapper the compile package lets a caller install (CompiledModel.wrap_pieces), and here that
wrapper replays the piece's graph for the active bucket. Outside `active(bucket, action)`
calls pass through.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from kiln.cudagraph.pool import CapturedCudagraph, CudagraphPool


class PiecewiseCudagraphs:
    def __init__(self, pool: CudagraphPool | None):
        self.pool = pool
        self.bucket: int | None = None
        self.action: str | None = None  # "replay" | "capture" | None: pass through

    @contextlib.contextmanager
    def active(self, bucket: int, action: str):
        self.bucket, self.action = bucket, action
        try:
            yield
        finally:
            self.bucket = self.action = None

    def wrap(self, piece: Callable) -> Callable:
        return CudagraphPiece(piece, self)


class CudagraphPiece:
    def __init__(self, piece: Callable, graphs: PiecewiseCudagraphs):
        self.piece, self.graphs = piece, graphs
        self.by_bucket: dict[int, CapturedCudagraph] = {}

    def __call__(self, *args):
        graphs = self.graphs
        if graphs.action is None:
            return self.piece(*args)
        if graphs.action == "replay":
            return self.by_bucket[graphs.bucket].replay(*args)
        self.by_bucket[graphs.bucket], out = graphs.pool.capture(self.piece, *args)
        return out
