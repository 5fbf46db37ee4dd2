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

# Host staging buffers a StepBuffers cycles through on the GPU. A step's copies from its slot are
# asynchronous; the slot is written again STAGING_SLOTS steps later, after waiting for them. A
# fresh pinned tensor each step instead took ~1/4 of the engine thread's time in -O2 serving
# (py-spy, H100, 32 req/s: torch.empty(pin_memory=True) and torch.tensor(list) in this method).
STAGING_SLOTS = 4


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
        self._staging = [_Staging(max_tokens, max_seqs, max_blocks_per_seq, self._pin)
                         for _ in range(STAGING_SLOTS if self._pin else 1)]
        self._next_staging = 0

    def load(self, step: PackedStep, num_tokens: int, num_seqs: int, max_query_len: int,
             max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Write `step` padded to `num_tokens` tokens and `num_seqs` sequences; returns views
        (input ids, positions, metadata). The metadata's Python ints are what a graph captured
        for this shape was captured with; pass the real ones when no full graph runs."""
        n, s = step.num_tokens, len(step.seq_lens)
        if num_tokens > self.max_tokens or num_seqs > self.max_seqs or n > num_tokens or s > num_seqs:
            raise ValueError(f"a step of {n} tokens / {s} sequences padded to {num_tokens} / {num_seqs} "
                             f"does not fit buffers of {self.max_tokens} / {self.max_seqs}")
        slot = self._staging[self._next_staging]
        self._next_staging = (self._next_staging + 1) % len(self._staging)
        if self._pin:  # its copies of STAGING_SLOTS steps ago: long done, as a rule
            slot.copied.synchronize()
        # Filled through numpy: a list goes in without a temporary tensor.
        tokens, seqs = slot.tokens_np, slot.seqs_np
        tokens[0, :n], tokens[1, :n], tokens[2, :n] = step.input_ids, step.positions, step.slots
        tokens[:2, n:num_tokens] = 0
        tokens[2, n:num_tokens] = -1
        seqs[0, :s] = step.seq_lens
        seqs[0, s:num_seqs] = 0
        seqs[1, : s + 1] = step.query_start_loc
        seqs[1, s + 1: num_seqs + 1] = n
        self.input_ids[:num_tokens].copy_(slot.tokens[0, :num_tokens], non_blocking=self._pin)
        self.positions[:num_tokens].copy_(slot.tokens[1, :num_tokens], non_blocking=self._pin)
        self.slot_mapping[:num_tokens].copy_(slot.tokens[2, :num_tokens], non_blocking=self._pin)
        self.seq_lens[:num_seqs].copy_(slot.seqs[0, :num_seqs], non_blocking=self._pin)
        self.query_start_loc[: num_seqs + 1].copy_(slot.seqs[1, : num_seqs + 1], non_blocking=self._pin)
        if step.block_tables:
            width = max(len(t) for t in step.block_tables)
            # Staged contiguous (s x width), so that the copy's source is the pinned memory itself.
            slot.tables_np[: s * width].reshape(s, width)[:] = [t + [0] * (width - len(t)) for t in step.block_tables]
            self.block_tables[:s, :width].copy_(slot.tables[: s * width].view(s, width), non_blocking=self._pin)
        if self._pin:
            slot.copied.record()
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens], block_tables=self.block_tables[:num_seqs],
            seq_lens=self.seq_lens[:num_seqs], query_start_loc=self.query_start_loc[: num_seqs + 1],
            max_query_len=max_query_len, max_seq_len=max_seq_len, num_actual_tokens=n,
            seq_lens_cpu=step.seq_lens + [0] * (num_seqs - s),
            query_start_loc_cpu=step.query_start_loc + [n] * (num_seqs - s))
        return self.input_ids[:num_tokens], self.positions[:num_tokens], meta


class _Staging:
    """One step's host copies of the inputs: pinned on the GPU, with numpy views to fill them."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, pin: bool):
        self.tokens = torch.empty(3, max_tokens, dtype=torch.long, pin_memory=pin)  # ids, positions, slots
        self.seqs = torch.empty(2, max_seqs + 1, dtype=torch.int32, pin_memory=pin)  # seq_lens, query starts
        self.tables = torch.empty(max_seqs * max_blocks, dtype=torch.int32, pin_memory=pin)
        self.tokens_np, self.seqs_np, self.tables_np = self.tokens.numpy(), self.seqs.numpy(), self.tables.numpy()
        # Recorded after the last step's copies from here (waiting on one never recorded returns at once).
        self.copied = torch.cuda.Event() if pin else None
