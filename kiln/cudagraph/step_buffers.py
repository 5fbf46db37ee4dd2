"""Persistent device buffers every step is packed into.

A CUDA graph reads its inputs (token ids, positions, and inside a full graph the attention
metadata) from the addresses it saw at capture. So each step writes into the front of
these buffers and passes views of them: the same slice for the same bucket, every time.
Rows past the real batch are padding: token 0 at position 0, KV slot -1 (not written),
and sequences with no query tokens and an empty context (attention skips them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.forward_context import AttentionMetadata


@dataclass
class PackedStep:
    """One step's rows as host lists, before padding."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]
    seq_lens: list[int]
    query_start_loc: list[int]  # len(seq_lens) + 1 entries

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


class StepBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device):
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks_per_seq
        self.device = device
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self._pin = device.type == "cuda"

    def load(self, step: PackedStep, num_tokens: int, num_seqs: int, max_query_len: int,
             max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Write `step` padded to `num_tokens` tokens and `num_seqs` sequences; returns views
        (input ids, positions, metadata). The metadata's Python ints are what a graph captured
        for this shape was captured with; pass the real ones when no full graph runs."""
        n, s = step.num_tokens, len(step.seq_lens)
        if num_tokens > self.max_tokens or num_seqs > self.max_seqs or n > num_tokens or s > num_seqs:
            raise ValueError(f"a step of {n} tokens / {s} sequences padded to {num_tokens} / {num_seqs} "
                             f"does not fit buffers of {self.max_tokens} / {self.max_seqs}")
        # Fresh host staging each step, pinned on the GPU: torch's caching host allocator does not
        # hand the memory out again until the asynchronous copy from it has run (a reused buffer
        # would race a step that does not sample, and so never synchronises).
        tokens = torch.empty(3, num_tokens, dtype=torch.long, pin_memory=self._pin)
        tokens[0, :n] = torch.tensor(step.input_ids, dtype=torch.long)
        tokens[1, :n] = torch.tensor(step.positions, dtype=torch.long)
        tokens[2, :n] = torch.tensor(step.slots, dtype=torch.long)
        tokens[:2, n:] = 0
        tokens[2, n:] = -1
        seqs = torch.empty(2, num_seqs + 1, dtype=torch.int32, pin_memory=self._pin)
        seqs[0, :s] = torch.tensor(step.seq_lens, dtype=torch.int32)
        seqs[0, s:] = 0
        seqs[1, : s + 1] = torch.tensor(step.query_start_loc, dtype=torch.int32)
        seqs[1, s + 1:] = n
        self.input_ids[:num_tokens].copy_(tokens[0], non_blocking=self._pin)
        self.positions[:num_tokens].copy_(tokens[1], non_blocking=self._pin)
        self.slot_mapping[:num_tokens].copy_(tokens[2], non_blocking=self._pin)
        self.seq_lens[:num_seqs].copy_(seqs[0, :num_seqs], non_blocking=self._pin)
        self.query_start_loc[: num_seqs + 1].copy_(seqs[1], non_blocking=self._pin)
        if step.block_tables:
            width = max(len(t) for t in step.block_tables)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in step.block_tables], dtype=torch.int32)
            self.block_tables[:s, :width].copy_(tables, non_blocking=self._pin)
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens], block_tables=self.block_tables[:num_seqs],
            seq_lens=self.seq_lens[:num_seqs], query_start_loc=self.query_start_loc[: num_seqs + 1],
            max_query_len=max_query_len, max_seq_len=max_seq_len, num_actual_tokens=n,
            seq_lens_cpu=step.seq_lens + [0] * (num_seqs - s),
            query_start_loc_cpu=step.query_start_loc + [n] * (num_seqs - s))
        return self.input_ids[:num_tokens], self.positions[:num_tokens], meta
