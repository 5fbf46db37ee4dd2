"""A decode step's sampling as one CUDA graph replay, for batches of plain rows.

The full decode graph ends with the head (the logits and their argmax), so a greedy step
launches nothing after the replay; a step with sampled rows would launch ~35 kernels more
(the cuts, the Gumbel draw), ~1 ms of host time at batch 1. Here those run as a graph per
(bucket, Cuts), reading the forward graph's logits and argmax where that graph left them and
each row's settings and seed from static buffers; only the tokens come back.

A graph is captured the first time a step needs its (bucket, Cuts), not at start-up: a server
sees few of the pairs, and a start captures nothing more. Their memory comes from a pool of
their own, outside the forward graphs' shared pool (whose memory those reuse between captures);
the graphs are captured one after another and never run together, so the pool holds about one
program's temporaries (at batch 256 the scaled logits and the ranking, some hundreds of MB),
which the KV-cache profile reserves (`ModelRunner._profile_gpu_blocks`). A capture that fails
anyway (out of memory where the profile was wrong) leaves that (bucket, Cuts) to the eager
sampler, with a warning, instead of failing the step. Rows with logit_bias, penalties or
min_tokens, and structured output, take the eager sampler: their programs depend on each row's
history.
"""

from __future__ import annotations

import logging
import time

import torch

from kiln.cudagraph.pool import CudagraphPool
from kiln.engine.sampler import SETTINGS, Cuts, pinned, sample_rows, seeds_of, settings_of
from kiln.engine.sampling_params import SamplingParams

logger = logging.getLogger("kiln")

_PADDING = SamplingParams(temperature=0.0)  # rows past the batch: greedy, their token unused


class SamplingGraphs:
    def __init__(self, max_seqs: int, device: torch.device):
        self.settings = torch.zeros(len(SETTINGS), max_seqs, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(max_seqs, dtype=torch.long, device=device)
        # Off the GPU the program runs as it is, uncaptured: how the tests reach this path on the CPU.
        self.pool = CudagraphPool(device) if device.type == "cuda" else None
        # (bucket, cuts, where the logits and argmax are) -> (graph, its tokens)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.failed: set[tuple] = set()  # keys whose capture failed: the eager sampler's

    def sample(self, logits: torch.Tensor, greedy: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> torch.Tensor | None:
        """logits [bucket, vocab] and greedy [bucket]: a full decode graph's head outputs (the same
        addresses every step of the bucket); params and generators: the batch's rows, the first
        len(params) of the bucket's, every one plain(). -> int64 [len(params)], a new tensor; or
        None, the generators untouched, where this (bucket, Cuts) could not be captured."""
        bucket, n = logits.shape[0], len(params)
        cuts = Cuts.of(params, logits.device)
        key = (bucket, cuts, logits.data_ptr(), greedy.data_ptr())
        if key in self.failed:
            return None
        staged = settings_of(params + [_PADDING] * (bucket - n))
        self.settings[:, :bucket].copy_(pinned(staged, logits.device), non_blocking=True)
        if self.pool is not None and key not in self.graphs:
            # Before the seeds: a capture that fails must leave the generators for the eager sampler.
            try:
                self.graphs[key] = self._capture(logits, greedy, cuts)
            except RuntimeError as e:  # torch.OutOfMemoryError among them
                self.failed.add(key)
                logger.warning("could not capture the sampling graph of bucket %d for %s (%s); those steps "
                               "sample eagerly", bucket, cuts, str(e).splitlines()[0] if str(e) else type(e).__name__)
                return None
        # The seeds sample() would draw: one a sampled row (a greedy row's generator stays untouched).
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        seeds = [0] * bucket
        for i, seed in zip(sampled, seeds_of([generators[i] for i in sampled])):
            seeds[i] = seed
        self.seeds[:bucket].copy_(pinned(torch.tensor(seeds, dtype=torch.long), logits.device), non_blocking=True)
        if self.pool is None:
            return sample_rows(logits, greedy, self.settings[:, :bucket], self.seeds[:bucket], cuts)[:n]
        graph, tokens = self.graphs[key]
        graph.replay()
        return tokens[:n].clone()  # the next replay overwrites the graph's own

    def _capture(self, logits: torch.Tensor, greedy: torch.Tensor,
                 cuts: Cuts) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        bucket = logits.shape[0]
        settings, seeds = self.settings[:, :bucket], self.seeds[:bucket]
        start = time.perf_counter()
        with self.pool.session(collect=False), self.pool.capturing():
            # One ordinary run first: Triton compiles, torch's sort and topk size their workspace (the
            # seeds are the last step's: any value does).
            sample_rows(logits, greedy, settings, seeds, cuts)
            graph = self.pool.begin()
            try:
                tokens = sample_rows(logits, greedy, settings, seeds, cuts)
            finally:
                self.pool.end(graph)
        logger.info("captured the sampling graph of bucket %d for %s in %.1f ms (%d sampling graphs)", bucket,
                    cuts, (time.perf_counter() - start) * 1e3, len(self.graphs) + 1)
        return graph, tokens
